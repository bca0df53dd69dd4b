"""Stored transitions: the (x_t, x_t') pairs of a rollout's trained (stochastic) steps, for the
objectives that train on them (``trains_on = "transitions"``: grpo, grpo-guard).

An *item* of the update is a sample, its *units* are its S trained steps; the KL term's reference
prediction of every trained (sample, step) pair is computed once per iteration, without gradient
(:func:`reference`). :class:`Transitions` is what :func:`fgrpo.core.update.update` asks of the
points it trains on (:class:`fgrpo.core.points.TrainingPoints`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import torch

from fgrpo.core import tensors
from fgrpo.core.advantages import tree_advantages
from fgrpo.core.points.lockstep import plan
from fgrpo.core.protocols import StepBatch, Trajectory
from fgrpo.core.run import Run
from fgrpo.core.timing import TimedPolicy


def pair_batches(traj: Trajectory, samples: torch.Tensor, per_forward: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sample, step) pairs of the given samples, sample-major, in forward passes of ``per_forward``."""
    steps = traj.num_trained_steps
    rows = samples.repeat_interleave(steps)
    cols = torch.arange(steps).repeat(len(samples))
    size = per_forward or len(rows)
    return list(zip(rows.split(size), cols.split(size), strict=True))


def step_batch(
    run: Run, traj: Trajectory, adv: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, ref: Reference | None = None
) -> tuple[StepBatch, int]:
    """Re-evaluate the stored actions of these (sample, step) pairs under the current policy
    (``ref``: the reference pass of the KL term, see :func:`reference`)."""
    policy, kernel = TimedPolicy(run.learner.policy, run.io.clock), run.sampler.kernel
    x = traj.latents[rows, cols]
    x_next = traj.next_latents[rows, cols]
    index = traj.step_index[rows, cols]
    sigmas = traj.sigmas
    cond = tensors.index(traj.cond, rows)
    v = policy.velocity(x, sigmas[index], cond)
    new = kernel.step(v, x, sigmas, index, prev_sample=x_next)
    nfe = len(rows) * policy.evaluations_per_call
    ref_mean = ref_velocity = None
    if ref is not None:
        ref_mean, ref_velocity = ref.mean[rows, cols], ref.velocity[rows, cols]
    # a kernel with correlated noise whitens the means, so that ||mu - mu'||^2 / (2 std^2) in the
    # objectives (KL, GRPO-Guard's ratio norm) is the exact Mahalanobis form of its Gaussian
    white = getattr(kernel, "whiten", None) or (lambda t: t)
    batch = StepBatch(
        log_prob=new.log_prob,
        old_log_prob=traj.log_probs[rows, cols],
        advantages=step_advantages(traj, adv, rows, cols),
        mean=white(new.mean),
        old_mean=white(traj.means[rows, cols]),
        std=traj.stds[rows, cols],
        dt=sigmas[index + 1] - sigmas[index],
        velocity=v,
        ref_mean=None if ref_mean is None else white(ref_mean),
        ref_velocity=ref_velocity,
    )
    return batch, nfe


def step_advantages(traj: Trajectory, adv: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The advantage of these (sample, step) pairs: ``adv`` is (B,) per sample, or (B, S) per step
    (a tree rollout's, :func:`fgrpo.core.advantages.tree_advantages`), times the trajectory's
    ``policy_weight`` of the step where it has one."""
    a = adv[rows] if adv.dim() == 1 else adv[rows, cols]
    return a if traj.policy_weight is None else a * traj.policy_weight[rows, cols]


@attrs.frozen
class Reference:
    """The reference policy's mean and velocity at every stored (x_t, t): (B, S, *shape) each."""

    mean: torch.Tensor
    velocity: torch.Tensor
    nfe: int


@torch.no_grad()
def reference(run: Run, traj: Trajectory, samples: torch.Tensor) -> Reference | None:
    """The KL term's reference prediction of every trained (sample, step) pair of ``samples``,
    computed once per iteration without gradient (the reference does not change during the
    update, whatever the number of inner epochs), in forward passes of
    ``train.reference_batch_size`` pairs under one switch to the reference; None when the
    objective needs no reference."""
    if not run.objective.needs_reference:
        return None
    cfg = run.recipe.train
    policy, kernel = TimedPolicy(run.learner.policy, run.io.clock), run.sampler.kernel
    mean = torch.zeros_like(traj.means)
    velocity = torch.zeros_like(traj.means)
    nfe = 0
    passes = (
        pair_batches(traj, samples.to(traj.latents.device), cfg.reference_batch_size or cfg.micro_batch_size)
        if len(samples)
        else []
    )
    launch = run.learner.launch
    planned = plan(policy, passes, partial(levels, traj), launch.missing_forwards, launch.sharded_weights)
    with policy.reference():
        for made, level in planned:
            if made is None:
                with run.accelerator.autocast():
                    idle_velocity(policy, traj, level)
                continue
            rows, cols = made
            x, index = traj.latents[rows, cols], traj.step_index[rows, cols]
            with run.accelerator.autocast():
                v = policy.velocity(x, traj.sigmas[index], tensors.index(traj.cond, rows))
            velocity[rows, cols] = v.float()
            mean[rows, cols] = kernel.step(v, x, traj.sigmas, index, prev_sample=traj.next_latents[rows, cols]).mean
            nfe += len(rows) * policy.evaluations_per_call
    return Reference(mean=mean, velocity=velocity, nfe=nfe)


def levels(traj: Trajectory, made: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The noise level of each (sample, step) pair: where its stored transition starts."""
    rows, cols = made
    return traj.sigmas[traj.step_index[rows, cols]]


def idle_velocity(policy: Any, traj: Trajectory, level: float | None) -> torch.Tensor:
    """A padding pass's velocity: the first stored pair's state, at noise level ``level`` (None:
    the pair's own), so that it runs the forward group a padding pass of that level must."""
    first = torch.zeros(1, dtype=torch.long, device=traj.latents.device)
    sigma = traj.sigmas[traj.step_index[first, first]]
    if level is not None:
        sigma = torch.full_like(sigma, level)
    return policy.velocity(traj.latents[first, first], sigma, tensors.index(traj.cond, first))


def idle_passes(run: Run, traj: Trajectory, adv: torch.Tensor, count: int, level: float | None = None) -> None:
    """``count`` forward/backward passes that change no gradient (loss weight 0), on this process's
    first (sample, step) pair at noise level ``level`` (None: the pair's own): where every backward
    involves every process, a process makes as many passes as the busiest one
    (``run.learner.launch.missing_backwards``; per forward group, :mod:`fgrpo.core.points.lockstep`)."""
    policy = TimedPolicy(run.learner.policy, run.io.clock)
    for _ in range(count):
        with run.accelerator.autocast():
            v = idle_velocity(policy, traj, level)
        run.learner.launch.backward(v.float().sum() * 0.0)


class Transitions:
    """The stored (x_t, x_t') pairs of a rollout's trained steps (grpo, grpo-guard): the items of
    the update are its samples, each with its S trained steps; the reference pass (KL) is made
    once per iteration, whatever the epochs (``iteration`` changes nothing here)."""

    def __init__(self, run: Run, traj: Trajectory, adv: torch.Tensor, iteration: int = 0):
        self.run, self.traj = run, traj
        self.adv = self.advantages = adv  # per sample; ``advantages`` is what the zero-advantage filter reads
        if traj.step_nodes is not None:  # a tree rollout (BranchGRPO): each step its node's advantage
            self.adv = tree_advantages(adv, traj.group_index, traj.step_nodes).to(device=adv.device, dtype=adv.dtype)
            # a sample is informative when any step it trains is: a leaf whose own advantage is 0 may
            # still carry the edges of its ancestors, whose nodes' advantages are not
            weight = traj.policy_weight.to(adv.device) if traj.policy_weight is not None else 1.0
            self.advantages = (self.adv * weight).abs().amax(1)
        self.items = traj.batch_size
        self.units = traj.num_trained_steps
        self.ref: Reference | None = None
        self.ref_nfe = self.old_nfe = 0

    def prepare(self, kept: torch.Tensor, epoch: int) -> None:
        if epoch == 0:  # the reference does not change during the update, whatever the epochs
            self.ref = reference(self.run, self.traj, kept)
            self.ref_nfe = self.ref.nfe if self.ref is not None else 0
        else:
            self.ref_nfe = 0

    def per_forward(self, micro_batch_size: int) -> int:
        return micro_batch_size

    def passes(self, items: torch.Tensor, per_forward: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return pair_batches(self.traj, items.to(self.traj.latents.device), per_forward) if len(items) else []

    def batch(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[StepBatch, int]:
        return step_batch(self.run, self.traj, self.adv, rows, cols, self.ref)

    def deviation(self, batch: StepBatch) -> torch.Tensor:
        return (batch.log_prob.detach() - batch.old_log_prob).exp().sub(1).abs().max()

    def levels(self, made: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return levels(self.traj, made)

    def idle(self, count: int, level: float | None = None) -> None:
        idle_passes(self.run, self.traj, self.adv, count, level)
