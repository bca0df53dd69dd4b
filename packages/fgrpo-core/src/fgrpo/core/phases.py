"""The phases of one training iteration: rollout, advantages, update (scoring, between rollout and
advantages, is :mod:`fgrpo.core.scoring`).

Each is a plain function of the run and the data of the phase before it; ``trainer.iteration``
calls them in order.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch

from fgrpo.core import tensors
from fgrpo.core.advantages import combine
from fgrpo.core.ema import ema_weights
from fgrpo.core.protocols import ForwardObjective, StepBatch, Trajectory
from fgrpo.core.run import Run
from fgrpo.core.seeding import generator
from fgrpo.core.timing import TimedPolicy

# --- rollout -----------------------------------------------------------------------------------


@torch.no_grad()
def refresh_prompts(run: Run, iteration: int) -> bool | None:
    """A prompt source whose scenes depend on the policy (an optional ``refresh(policy, iteration,
    seed) -> bool``: e.g. starting states from the policy's own closed loop) updates them before
    the iteration's rollout; None when it has no such method. Its state travels in checkpoints
    (optional ``state_dict`` / ``load_state_dict``)."""
    refresh = getattr(run.prompts, "refresh", None)
    if refresh is None:
        return None
    return bool(refresh(run.policy, iteration, run.recipe.seed))


def autocast(device: torch.device | str, precision: str) -> contextlib.AbstractContextManager:
    if precision == "same":
        return contextlib.nullcontext()
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[precision]
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def cat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    fields = ("group_index", "step_index", "latents", "next_latents", "log_probs", "means", "stds", "final")
    joined = {name: torch.cat([getattr(p, name) for p in parts]) for name in fields}
    if first.policy_weight is not None:
        weights = [p.policy_weight for p in parts if p.policy_weight is not None]
        if len(weights) != len(parts):
            raise ValueError("trajectories to join: some have a policy_weight and some do not")
        joined["policy_weight"] = torch.cat(weights)
    return Trajectory(
        prompts=[p for part in parts for p in part.prompts],
        cond=tensors.cat([p.cond for p in parts]),
        sigmas=first.sigmas,
        nfe=sum(p.nfe for p in parts),
        info={"chunks": [p.info for p in parts]},
        **joined,
    )


@torch.no_grad()
def rollout(run: Run, iteration: int, on_chunk: Callable[[Trajectory], None] | None = None) -> Trajectory:
    """This process's prompt groups, rolled out in chunks whose noise depends only on the chunk's
    global prompt slots: 1 or N processes draw the same samples. ``on_chunk`` receives each
    chunk as soon as it is sampled (the reward worker scores it while the next one rolls out)."""
    cfg = run.recipe.train
    local = run.schedule.local(iteration)
    chunk = cfg.rollout_prompts or len(local)
    parts = []
    policy = TimedPolicy(run.policy, run.clock)
    with run.display.phase("rollout", len(local)) as advance, sampling_policy(run):
        for start in range(0, len(local), chunk):
            slots, prompts = zip(*local[start : start + chunk], strict=True)
            g = generator(run.recipe.seed, "rollout", iteration, slots[0], device=run.policy.device)
            with run.accelerator.autocast(), autocast(run.policy.device, cfg.rollout_precision):
                traj = run.sampler.rollout(policy, list(prompts), cfg.group_size, generator=g)
            # group ids become global prompt slots: unique across chunks and processes
            traj.group_index = torch.as_tensor(slots, device=traj.group_index.device)[traj.group_index]
            parts.append(traj)
            if on_chunk is not None:
                on_chunk(traj)
            advance(len(slots))
    return cat_trajectories(parts)


def sampling_policy(run: Run) -> contextlib.AbstractContextManager:
    """The weights rollouts come from: the objective's old policy when it samples from it
    (DiffusionNFT), else the current ones."""
    return ema_weights(run.old if getattr(run.objective, "samples_from_old", False) else None)


def nfe_by_phase(traj: Trajectory) -> dict[str, int]:
    """The rollout's NFE split by the sampler's phases (prefix, window, flash, ...), over chunks."""
    out: dict[str, int] = {}
    for info in traj.info.get("chunks", [traj.info]):
        for phase, n in (info.get("nfe") or {}).items():
            out[phase] = out.get(phase, 0) + int(n)
    return out


# --- advantages --------------------------------------------------------------------------------


def advantages(run: Run, traj: Trajectory, scores: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-normalised advantages computed on the whole batch gathered from every process
    (identically on each), then this process's slice."""
    acc = run.accelerator
    device = run.policy.device
    gathered = {k: acc.gather(v.to(device)) for k, v in scores.items()}
    groups = acc.gather(traj.group_index.to(device))
    weights = {spec.label or spec.name: spec.weight for spec in run.recipe.rewards}  # built specs carry their label
    cfg = run.recipe.train
    adv, stats = combine(
        gathered,
        weights,
        groups,
        mode=cfg.advantage,
        global_std=cfg.global_std,
        eps=cfg.advantage_eps,
        per_prompt=cfg.per_prompt,
        unbiased=cfg.advantage_std == "unbiased",
    )
    # what the update leaves out (samples whose advantage is exactly 0), over every process
    stats["dropped_fraction"] = (adv == 0).double().mean().item() if cfg.drop_zero_advantage else 0.0
    n = traj.batch_size
    local = adv[acc.process_index * n : (acc.process_index + 1) * n]
    return local.to(device=device, dtype=torch.float32), stats


# --- update ------------------------------------------------------------------------------------


@attrs.define
class UpdateStats:
    metrics: dict[str, list[torch.Tensor]] = attrs.Factory(lambda: defaultdict(list))
    optimizer_steps: int = 0
    samples: int = 0  # samples the update trained on (after the zero-advantage filter)
    nfe: int = 0  # the update's forwards, the reference pass included
    reference_nfe: int = 0  # the reference pass alone
    old_nfe: int = 0  # the old policy's pass alone (forward-process objectives)
    first_ratio_deviation: torch.Tensor | None = None  # max |ratio - 1| before the first optimizer step
    grad_norms: list[torch.Tensor] = attrs.Factory(list)

    def prepared(self, reference_nfe: int, old_nfe: int) -> None:
        """The forwards an epoch's preparation made (reference and old-policy passes)."""
        self.reference_nfe += reference_nfe
        self.old_nfe += old_nfe
        self.nfe += reference_nfe + old_nfe

    def record(self, metrics: dict[str, torch.Tensor], nfe: int, deviation: Callable[[], torch.Tensor | None]) -> None:
        """One pass's forwards and metrics, kept on device (read once, by :func:`summarize`);
        before the first optimizer step also ``deviation()``, the pass's largest departure from
        the sampling policy (|ratio - 1|, or the relative velocity difference to the old policy)."""
        self.nfe += nfe
        for key, value in metrics.items():
            self.metrics[key].append(value.detach())
        if self.optimizer_steps == 0:
            dev = deviation()
            first = self.first_ratio_deviation
            if dev is not None:
                self.first_ratio_deviation = dev if first is None else torch.maximum(first, dev)


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
    policy, kernel = TimedPolicy(run.policy, run.clock), run.sampler.kernel
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
        advantages=adv[rows] if traj.policy_weight is None else adv[rows] * traj.policy_weight[rows, cols],
        mean=white(new.mean),
        old_mean=white(traj.means[rows, cols]),
        std=traj.stds[rows, cols],
        dt=sigmas[index + 1] - sigmas[index],
        velocity=v,
        ref_mean=None if ref_mean is None else white(ref_mean),
        ref_velocity=ref_velocity,
    )
    return batch, nfe


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
    policy, kernel = TimedPolicy(run.policy, run.clock), run.sampler.kernel
    mean = torch.zeros_like(traj.means)
    velocity = torch.zeros_like(traj.means)
    nfe = 0
    passes = (
        pair_batches(traj, samples.to(traj.latents.device), cfg.reference_batch_size or cfg.micro_batch_size)
        if len(samples)
        else []
    )
    padding = run.parallel.missing_forwards(len(passes))
    with policy.reference():
        for rows, cols in passes:
            x, index = traj.latents[rows, cols], traj.step_index[rows, cols]
            with run.accelerator.autocast():
                v = policy.velocity(x, traj.sigmas[index], tensors.index(traj.cond, rows))
            velocity[rows, cols] = v.float()
            mean[rows, cols] = kernel.step(v, x, traj.sigmas, index, prev_sample=traj.next_latents[rows, cols]).mean
            nfe += len(rows) * policy.evaluations_per_call
        first = torch.zeros(1, dtype=torch.long, device=traj.latents.device)
        for _ in range(padding):
            with run.accelerator.autocast():
                policy.velocity(
                    traj.latents[first, first],
                    traj.sigmas[traj.step_index[first, first]],
                    tensors.index(traj.cond, first),
                )
    return Reference(mean=mean, velocity=velocity, nfe=nfe)


def idle_passes(run: Run, traj: Trajectory, adv: torch.Tensor, count: int) -> None:
    """``count`` forward/backward passes that change no gradient (loss weight 0), on this process's
    first (sample, step) pair: where every backward involves every process, a process makes as
    many passes as the busiest one (``run.parallel.missing_backwards``)."""
    one = torch.zeros(1, dtype=torch.long, device=traj.latents.device)
    for _ in range(count):
        with run.accelerator.autocast():
            batch, _ = step_batch(run, traj, adv, one, one)
        assert batch.velocity is not None  # step_batch always computes it
        run.parallel.backward(batch.velocity.float().sum() * 0.0)


def informative(run: Run, adv: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This process's samples the update trains on, and the most any process has.

    With ``train.drop_zero_advantage`` (flow_grpo) samples whose advantage is exactly 0 (flat
    groups) are left out, so the policy loss and the KL average over informative samples only;
    otherwise every sample."""
    n = adv.shape[0]
    if not run.recipe.train.drop_zero_advantage:
        return torch.arange(n), n
    kept = (adv != 0).nonzero().squeeze(1).cpu()
    counts = run.accelerator.gather(torch.tensor([len(kept)], device=adv.device))
    return kept, int(counts.max())


def minibatches(
    kept: torch.Tensor, most: int, n: int, per_step: int, order: torch.Tensor | None
) -> list[torch.Tensor]:
    """``kept`` (in the order ``order`` permutes them) split into the minibatches of one epoch.

    Without dropped samples: minibatches of ``per_step`` samples. When samples were dropped, each
    minibatch shrinks in proportion (ceil(most * per_step / n) samples), as flow_grpo's keep their
    number; every process makes the same number of minibatches (empty ones where it has fewer
    samples), since each one ends with a gradient all-reduce."""
    if most == 0:
        return []
    size = math.ceil(most * per_step / n)
    chunks = list((kept if order is None else kept[order]).split(size))
    return chunks + [kept[:0]] * (math.ceil(most / size) - len(chunks))


class Transitions:
    """The stored (x_t, x_t') pairs of a rollout's trained steps (grpo, grpo-guard): the items of
    the update are its samples, each with its S trained steps; the reference pass (KL) is made
    once per iteration. :class:`fgrpo.core.forward.ForwardPoints` is the other kind: the update
    below serves both through these methods, the launch kind through ``run.parallel``."""

    def __init__(self, run: Run, traj: Trajectory, adv: torch.Tensor):
        self.run, self.traj, self.adv = run, traj, adv
        self.advantages = adv
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

    def idle(self, count: int) -> None:
        idle_passes(self.run, self.traj, self.adv, count)


def training_points(run: Run, traj: Trajectory, adv: torch.Tensor, iteration: int) -> Any:
    """What the objective trains on (``Objective.trains_on``): stored transitions, or forward-process points."""
    if getattr(run.objective, "trains_on", "transitions") == "forward":
        from fgrpo.core.forward import ForwardPoints

        return ForwardPoints(run, traj, adv, iteration)
    return Transitions(run, traj, adv)


def epoch_steps(
    run: Run, points: Any, kept: torch.Tensor, most: int, iteration: int, epoch: int
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """One epoch's optimizer steps, each as its forward passes of (item, unit) pairs: the kept
    items in minibatches (shuffled per epoch with ``train.shuffle_minibatches``),
    ``gradient_accumulation_steps`` minibatches per step (accelerate's setting by default, 1),
    ``train.micro_batch_size`` network rows per forward."""
    cfg = run.recipe.train
    n = points.traj.batch_size  # what train.minibatch_size is a share of
    accumulate = max(1, int(run.accelerator.gradient_accumulation_steps))
    order = (
        torch.randperm(len(kept), generator=generator(run.recipe.seed, "minibatch", iteration, epoch))
        if cfg.shuffle_minibatches
        else None
    )
    batches = minibatches(kept, most, n, cfg.minibatch_size or n, order)
    per_forward = points.per_forward(cfg.micro_batch_size)
    return [
        [pair for items in batches[first : first + accumulate] for pair in points.passes(items, per_forward)]
        for first in range(0, len(batches), accumulate)
    ]


def update_steps(run: Run, points: Any, most: int) -> int:
    """How many optimizer steps :func:`update` makes (for the progress display)."""
    cfg = run.recipe.train
    n = points.traj.batch_size  # what train.minibatch_size is a share of
    per_epoch = math.ceil(most / math.ceil(most * (cfg.minibatch_size or n) / n)) if most else 0
    return cfg.inner_epochs * math.ceil(per_epoch / max(1, int(run.accelerator.gradient_accumulation_steps)))


def train_pass(
    run: Run, points: Any, rows: torch.Tensor, cols: torch.Tensor, weight: float, stats: UpdateStats
) -> None:
    """Forward and backward of the objective on one pass of (item, unit) pairs, its loss weighted
    by ``weight`` (the pass's share of the optimizer step's pairs)."""
    with run.accelerator.autocast():
        batch, nfe = points.batch(rows, cols)
        out = run.objective(batch)
    loss = out.loss * weight
    with run.clock.section("model"):
        run.parallel.backward(loss)
    stats.record(out.metrics, nfe, lambda: points.deviation(batch))


def optimizer_step(run: Run, stats: UpdateStats) -> None:
    """One step on the accumulated gradients (averaged over the processes, unscaled, clipped to
    ``train.max_grad_norm``: :meth:`~fgrpo.core.launch.Launch.step`), then the EMA's."""
    cfg = run.recipe.train
    norm = run.parallel.step(run.optimizer, run.trainable, cfg.max_grad_norm)
    if norm is not None:
        stats.grad_norms.append(norm)
    stats.optimizer_steps += 1
    run.optimizer_steps += 1
    if run.ema is not None and run.ema.due(run.optimizer_steps, cfg.ema_every, cfg.ema_rule):
        for _ in range(cfg.ema_repeats):  # flow_grpo: once per minibatch, the weights unchanged in between
            run.ema.update(run.ema.warmup_decay(run.optimizer_steps) if cfg.ema_warmup else None)


def update(run: Run, traj: Trajectory, adv: torch.Tensor, iteration: int) -> UpdateStats:
    """The update, for both kinds of training points (:func:`training_points`): per epoch, the
    points' preparation (the reference pass; forward-process points: drawn, with the old policy's
    and the reference's predictions), then for every optimizer step (:func:`epoch_steps`) the
    objective's loss on each of its passes, weighted so that the gradient is the mean over all
    their (item, unit) pairs (a unit: a trained step, or a point), then one step. Forwards run
    under the run's mixed precision (accelerate's autocast); with fp16 the loss is scaled."""
    stats = UpdateStats()
    points = training_points(run, traj, adv, iteration)
    kept, most = informative(run, points.advantages)
    stats.samples = len(kept)
    with run.display.phase("update", update_steps(run, points, most)) as advance:
        for epoch in range(run.recipe.train.inner_epochs):
            points.prepare(kept, epoch)
            stats.prepared(points.ref_nfe, points.old_nfe)
            for passes in epoch_steps(run, points, kept, most, iteration, epoch):
                run.parallel.zero_grad(run.optimizer)
                idle = run.parallel.missing_backwards(len(passes))  # a collective: before any pass
                units = sum(len(rows) for rows, _ in passes)
                for rows, cols in passes:
                    train_pass(run, points, rows, cols, len(rows) / units, stats)
                points.idle(idle)
                optimizer_step(run, stats)
                advance()
    return stats


def move_old_policy(run: Run) -> None:
    """After an iteration's update: the objective's old policy <- d old + (1 - d) current, with d
    its decay after the run's optimizer steps so far (``Objective.old_decay``)."""
    if run.old is not None:
        run.old.update(cast(ForwardObjective, run.objective).old_decay(run.optimizer_steps))


def summarize(stats: UpdateStats) -> dict[str, float]:
    """The update's metrics as numbers: everything the loop kept on device is read here, in one
    transfer."""
    keys = list(stats.metrics)
    values = []
    for key in keys:
        stacked = torch.stack([v.float().reshape(()) for v in stats.metrics[key]])
        values.append(
            stacked.min() if key.endswith("_min") else stacked.max() if key.endswith("_max") else stacked.mean()
        )
    if stats.grad_norms:
        keys.append("grad_norm")
        values.append(torch.stack([g.float().reshape(()) for g in stats.grad_norms]).mean())
    if stats.first_ratio_deviation is not None:
        keys.append("first_ratio_deviation")
        values.append(torch.as_tensor(stats.first_ratio_deviation).float().reshape(()))
    out: dict[str, float] = dict(zip(keys, torch.stack(values).double().tolist(), strict=True)) if values else {}
    out["optimizer_steps"] = stats.optimizer_steps
    out["trained_samples"] = stats.samples
    out["nfe_reference"] = stats.reference_nfe
    out["nfe_old"] = stats.old_nfe
    return out
