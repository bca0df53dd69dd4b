"""The update: the objective's loss on the iteration's training points, optimizer steps, the EMA
and the objective's old policy.

One loop serves both kinds of training points (:mod:`fgrpo.core.points`: stored transitions, or
forward-process points), the launch kind through ``run.learner.launch``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import cast

import attrs
import torch

from fgrpo.core.points import TrainingPoints, lockstep, training_points
from fgrpo.core.points.lockstep import Pass, Planned
from fgrpo.core.protocols import ForwardObjective, Trajectory
from fgrpo.core.run import Run
from fgrpo.core.seeding import generator


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


def epoch_steps(
    run: Run, points: TrainingPoints, kept: torch.Tensor, most: int, iteration: int, epoch: int
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


def update_steps(run: Run, points: TrainingPoints, most: int) -> int:
    """How many optimizer steps :func:`update` makes (for the progress display)."""
    cfg = run.recipe.train
    n = points.traj.batch_size  # what train.minibatch_size is a share of
    per_epoch = math.ceil(most / math.ceil(most * (cfg.minibatch_size or n) / n)) if most else 0
    return cfg.inner_epochs * math.ceil(per_epoch / max(1, int(run.accelerator.gradient_accumulation_steps)))


def train_pass(
    run: Run, points: TrainingPoints, rows: torch.Tensor, cols: torch.Tensor, weight: float, stats: UpdateStats
) -> None:
    """Forward and backward of the objective on one pass of (item, unit) pairs, its loss weighted
    by ``weight`` (the pass's share of the optimizer step's pairs)."""
    with run.accelerator.autocast():
        batch, nfe = points.batch(rows, cols)
        out = run.objective(batch)
    loss = out.loss * weight
    with run.io.clock.section("model"):
        run.learner.launch.backward(loss)
    stats.record(out.metrics, nfe, lambda: points.deviation(batch))


def step_plan(run: Run, points: TrainingPoints, passes: list[Pass]) -> list[Planned]:
    """An optimizer step's passes with the launch's padding passes (zero-weighted), where every
    backward involves every process in the same order of forward groups (:mod:`fgrpo.core.points.lockstep`)."""
    launch = run.learner.launch
    return lockstep.plan(run.learner.policy, passes, points.levels, launch.missing_backwards, launch.sharded)


def optimizer_step(run: Run, stats: UpdateStats) -> None:
    """One step on the accumulated gradients (averaged over the processes, unscaled, clipped to
    ``train.max_grad_norm``: :meth:`~fgrpo.core.launch.Launch.step`), then the EMA's."""
    cfg = run.recipe.train
    norm = run.learner.launch.step(run.learner.optimizer, run.learner.trainable, cfg.max_grad_norm)
    if norm is not None:
        stats.grad_norms.append(norm)
    stats.optimizer_steps += 1
    run.learner.optimizer_steps += 1
    learner = run.learner
    if learner.ema is not None and learner.ema.due(learner.optimizer_steps, cfg.ema_every, cfg.ema_rule):
        for _ in range(cfg.ema_repeats):  # flow_grpo: once per minibatch, the weights unchanged in between
            learner.ema.update(learner.ema.warmup_decay(learner.optimizer_steps) if cfg.ema_warmup else None)


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
    with run.io.display.bar("update", update_steps(run, points, most)) as advance:
        for epoch in range(run.recipe.train.inner_epochs):
            points.prepare(kept, epoch)
            stats.prepared(points.ref_nfe, points.old_nfe)
            for passes in epoch_steps(run, points, kept, most, iteration, epoch):
                run.learner.launch.zero_grad(run.learner.optimizer)
                units = sum(len(rows) for rows, _ in passes)
                for made, level in step_plan(run, points, passes):  # a collective: before any pass
                    if made is None:
                        points.idle(1, level)
                    else:
                        train_pass(run, points, *made, len(made[0]) / units, stats)
                optimizer_step(run, stats)
                advance()
    return stats


def move_old_policy(run: Run) -> None:
    """After an iteration's update: the objective's old policy <- d old + (1 - d) current, with d
    its decay after the run's optimizer steps so far (``Objective.old_decay``)."""
    if run.learner.old_policy is not None:  # kept when the objective needs_old: a forward-process objective
        objective = cast(ForwardObjective, run.objective)
        run.learner.old_policy.update(objective.old_decay(run.learner.optimizer_steps))


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
