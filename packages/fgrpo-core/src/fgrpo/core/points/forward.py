"""Forward-process training points: the finished samples of a rollout re-noised at drawn levels.

For the objectives that train on the forward process (``trains_on = "forward"``: nft, awm, dpo).
An *item* is what minibatches are made of: a sample, or for a pairwise objective a (preferred,
rejected) pair of samples of one group, or for a grouped objective (dgpo) a whole prompt group; each
item has K *points* (t, noise), drawn at the start of
every epoch from a generator seeded by (seed, iteration, epoch, the item's global sample ids), so
that a resumed run, or the same run on another number of processes, draws the same points. The
item's samples share them. x_t = (1 - t) x0 + t noise.

Before the epoch's optimizer steps, the old policy's and the reference's predictions at every point
the objective asks for are computed once, without gradient, in forward passes of
``train.reference_batch_size`` rows (0: ``micro_batch_size``) under one switch each (the old
policy's weights swapped in; the adapter disabled). The update then makes one forward with
gradient per point (:meth:`ForwardPoints.batch`).

:class:`ForwardPoints` gives :func:`fgrpo.core.update.update` what
:class:`~fgrpo.core.points.transitions.Transitions` gives it for stored transitions; the loop itself
is the same for both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch

from fgrpo.core import tensors
from fgrpo.core.ema import ema_weights
from fgrpo.core.points.lockstep import plan
from fgrpo.core.protocols import ForwardBatch, ForwardObjective, Trajectory
from fgrpo.core.run import Run
from fgrpo.core.seeding import generator, randn
from fgrpo.core.timing import TimedPolicy


def needs_old(run: Run) -> bool:
    """The old policy's predictions are computed: the objective uses them, or ``fgrpo check``
    compares the first update's predictions with them (then, without an old policy, with the
    current weights' own)."""
    return run.objective.needs_old or run.checking


def grouped_members(group_index: torch.Tensor) -> torch.Tensor:
    """(groups, G) the sample indices of each prompt group, groups in sorted order; every group
    must have the same size."""
    rows = [(group_index == g).nonzero().squeeze(1) for g in torch.unique(group_index, sorted=True).tolist()]
    if len({len(r) for r in rows}) > 1:
        raise ValueError(f"a grouped objective needs equal groups, got sizes {sorted({len(r) for r in rows})}")
    return torch.stack(rows).to(torch.long)


class ForwardPoints:
    """The forward-process points of one update (see the module docstring)."""

    def __init__(self, run: Run, traj: Trajectory, adv: torch.Tensor, iteration: int):
        self.run, self.traj, self.iteration = run, traj, iteration
        # these points are made for an objective that trains on them: trains_on == "forward"
        self.objective = cast(ForwardObjective, run.objective)
        self.pairwise = self.objective.pairwise
        self.grouped = bool(getattr(self.objective, "grouped", False))
        if self.pairwise:
            # pairs are formed inside groups, and every group lies on one process
            self.members = self.objective.pairs(adv, traj.group_index).to(torch.long)
            self.advantages = torch.ones(len(self.members), device=adv.device)  # every pair is informative
            self.sign = torch.tensor([1.0, -1.0], device=adv.device)
        elif self.grouped:
            # a prompt group is one item (every group lies on one process): its samples share the points
            self.members = grouped_members(traj.group_index.cpu())
            self.advantages = adv[self.members.to(adv.device)].abs().amax(1)  # a flat group is uninformative
        else:
            self.members = torch.arange(traj.batch_size)[:, None]
            self.advantages = adv
        self.adv = adv
        assert traj.sample_ids is not None, "the trainer's rollout gives every sample its global id"
        self.ids = traj.sample_ids.cpu()
        self.units = 0  # points per item, known once drawn
        self.t: torch.Tensor | None = None  # (items, K)
        self.noise: torch.Tensor | None = None  # (items, K, *shape)
        self.old: torch.Tensor | None = None  # (items, R, K, *shape)
        self.ref: torch.Tensor | None = None
        self.old_nfe = self.ref_nfe = 0

    @property
    def items(self) -> int:
        return len(self.members)

    # --- the epoch's points ---------------------------------------------------------------------

    def prepare(self, kept: torch.Tensor, epoch: int) -> None:
        """Draw the kept items' points for ``epoch``, then the old/reference predictions at them."""
        self.draw(kept, epoch)
        run = self.run
        self.old = self.ref = None
        self.old_nfe = self.ref_nfe = 0
        if needs_old(run):
            with ema_weights(run.learner.old_policy):
                self.old, self.old_nfe = self.predict(kept)
        if run.objective.needs_reference:
            with run.learner.policy.reference():
                self.ref, self.ref_nfe = self.predict(kept)

    def draw(self, kept: torch.Tensor, epoch: int) -> None:
        traj, seed = self.traj, self.run.recipe.seed
        device = traj.final.device
        shape = tuple(traj.final.shape[1:])
        t_rows, noise_rows = {}, {}
        for item in kept.tolist():
            ids = [int(self.ids[m]) for m in self.members[item].tolist()]
            g = generator(seed, "points", self.iteration, epoch, *ids)
            t = self.objective.point_times(traj.sigmas, g)
            t_rows[item] = t.to(device=device, dtype=torch.float32)
            noise_rows[item] = randn((len(t), *shape), g, device)
        k = len(next(iter(t_rows.values()))) if t_rows else self.units
        self.units = k
        self.t = torch.zeros((self.items, k), device=device)
        self.noise = torch.zeros((self.items, k, *shape), device=device)
        for item in t_rows:
            self.t[item], self.noise[item] = t_rows[item], noise_rows[item]

    def rows(self, items: torch.Tensor, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(samples, points, items) of the network rows of these (item, point) pairs: one row each,
        or for pairs the preferred samples' rows, then the rejected samples' (same points)."""
        members = self.members[items.cpu()]
        samples = members.t().reshape(-1)
        repeat = members.shape[1]
        return samples, points.repeat(repeat), items.repeat(repeat)

    def x_t(self, samples: torch.Tensor, items: torch.Tensor, points: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dev = self.traj.final.device
        samples, items, points = samples.to(dev), items.to(dev), points.to(dev)
        x0 = self.traj.final[samples].float()
        assert self.t is not None and self.noise is not None  # drawn when the update starts
        t = self.t[items, points]
        noise = self.noise[items, points]
        tt = t.reshape(-1, *([1] * (x0.dim() - 1)))
        return x0, t, noise, (1 - tt) * x0 + tt * noise

    @torch.no_grad()
    def predict(self, kept: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The current weights' (as swapped in or switched by the caller) predictions at every
        point of the kept items, without gradient: (items, R, K, *shape) and their NFE."""
        run, traj = self.run, self.traj
        policy = TimedPolicy(run.learner.policy, run.io.clock)
        r = self.members.shape[1]
        out = torch.zeros((self.items, r, self.units, *traj.final.shape[1:]), device=traj.final.device)
        cfg = run.recipe.train
        passes = list(self.passes(kept, self.per_forward(cfg.reference_batch_size or cfg.micro_batch_size)))
        launch = run.learner.launch
        planned = plan(policy, passes, self.levels, launch.missing_forwards, launch.sharded_weights)
        nfe = 0
        for made, level in planned:  # the plan's collective was before any pass
            if made is None:
                self.idle_forward(policy, level)
                continue
            items, points = made
            samples, pts, its = self.rows(items, points)
            _, t, _, x_t = self.x_t(samples, its, pts)
            with run.accelerator.autocast():
                v = policy.velocity(x_t, t, tensors.index(traj.cond, samples.to(traj.final.device)))
            place = torch.arange(r).repeat_interleave(len(items))
            out[its.to(out.device), place.to(out.device), pts.to(out.device)] = v.float()
            nfe += len(samples) * policy.evaluations_per_call
        return out, nfe

    # --- the update's passes --------------------------------------------------------------------

    def passes(self, items: torch.Tensor, per_forward: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(item, point) pairs of ``items``, item-major, ``per_forward`` pairs per forward pass
        (a pair of samples counts once per point: its two rows share the forward)."""
        if not len(items):
            return iter(())
        rows = items.cpu().repeat_interleave(self.units)
        cols = torch.arange(self.units).repeat(len(items))
        size = per_forward or len(rows)
        return zip(rows.split(size), cols.split(size), strict=True)

    def per_forward(self, micro_batch_size: int) -> int:
        """(item, point) pairs per forward for ``train.micro_batch_size`` network rows."""
        if not micro_batch_size:
            return 0
        return max(1, micro_batch_size // self.members.shape[1])

    def batch(self, items: torch.Tensor, points: torch.Tensor) -> tuple[ForwardBatch, int]:
        """The :class:`ForwardBatch` of these (item, point) pairs, the velocity with gradient."""
        run, traj = self.run, self.traj
        policy = TimedPolicy(run.learner.policy, run.io.clock)
        samples, pts, its = self.rows(items, points)
        x0, t, noise, x_t = self.x_t(samples, its, pts)
        dev = traj.final.device
        v = policy.velocity(x_t, t, tensors.index(traj.cond, samples.to(dev)))
        place = torch.arange(self.members.shape[1]).repeat_interleave(len(items)).to(dev)
        its, pts = its.to(dev), pts.to(dev)
        if self.pairwise:
            advantages = self.sign[place]
        else:
            advantages = self.adv[samples.to(self.adv.device)]
        batch = ForwardBatch(
            advantages=advantages,
            t=t,
            x0=x0,
            noise=noise,
            x_t=x_t,
            velocity=v,
            old_velocity=self.old[its, place, pts] if self.old is not None else None,
            ref_velocity=self.ref[its, place, pts] if self.ref is not None else None,
            groups=its * self.units + pts if self.grouped else None,
        )
        return batch, len(samples) * policy.evaluations_per_call

    def deviation(self, batch: ForwardBatch) -> torch.Tensor | None:
        """max |v_θ - v_old| / (mean |v_old| + eps) over the batch: 0 when the update's predictions
        reproduce the old policy's (at the first step of a run, old = current)."""
        if batch.old_velocity is None:
            return None
        old = batch.old_velocity
        return ((batch.velocity.detach() - old).abs().max() / (old.abs().mean() + 1e-12)).float()

    def levels(self, made: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The drawn level t of each (item, point) pair (the rows of a pair of samples share it)."""
        assert self.t is not None  # drawn when the update starts
        items, points = made
        return self.t[items.to(self.t.device), points.to(self.t.device)]

    def idle(self, count: int, level: float | None = None) -> None:
        """``count`` forward/backward passes that change no gradient (``run.learner.launch.missing_backwards``)."""
        policy = TimedPolicy(self.run.learner.policy, self.run.io.clock)
        for _ in range(count):
            with self.run.accelerator.autocast():
                v = self.idle_forward(policy, level)
            self.run.learner.launch.backward(v.float().sum() * 0.0)

    def idle_forward(self, policy: Any, level: float | None = None) -> torch.Tensor:
        """A padding pass's velocity: the first sample at noise level ``level`` (None: 0.5)."""
        traj = self.traj
        one = torch.zeros(1, dtype=torch.long, device=traj.final.device)
        t = torch.full((1,), 0.5 if level is None else level, device=traj.final.device)
        return policy.velocity(traj.final[one].float(), t, tensors.index(traj.cond, one))
