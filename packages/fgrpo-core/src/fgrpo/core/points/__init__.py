"""What an update trains on: the training points of one iteration.

Two kinds, one per :data:`~fgrpo.core.protocols.TrainsOn`: the stored transitions of a rollout's
stochastic steps (:class:`~fgrpo.core.points.transitions.Transitions`, a
:class:`~fgrpo.core.protocols.StepBatch` per pass) and finished samples re-noised on the forward
process (:class:`~fgrpo.core.points.forward.ForwardPoints`, a
:class:`~fgrpo.core.protocols.ForwardBatch` per pass). :func:`fgrpo.core.update.update` asks the
same of both (:class:`TrainingPoints`); the objective's ``trains_on`` picks the kind.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

import torch

from fgrpo.core.points.forward import ForwardPoints
from fgrpo.core.points.transitions import Transitions
from fgrpo.core.protocols import ForwardBatch, StepBatch, Trajectory
from fgrpo.core.run import Run

BatchT = TypeVar("BatchT", StepBatch, ForwardBatch)


class TrainingPoints(Protocol[BatchT]):
    """An iteration's training points. *Items* are what minibatches are made of (a sample, or a
    pair of samples), each with ``units`` (its trained steps, or its drawn points); a pass is a set
    of (item, unit) pairs evaluated in one forward."""

    traj: Trajectory
    advantages: torch.Tensor  # (items,): the items without information (0) may be left out
    ref_nfe: int  # the last preparation's reference forwards
    old_nfe: int  # the last preparation's old-policy forwards

    def prepare(self, kept: torch.Tensor, epoch: int) -> None:
        """Before an epoch's steps: draw what the epoch draws, predict what the objective compares with."""

    def per_forward(self, micro_batch_size: int) -> int:
        """(item, unit) pairs per forward for ``train.micro_batch_size`` network rows (0: all)."""

    def passes(self, items: torch.Tensor, per_forward: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """The (item, unit) pairs of ``items``, in forwards of ``per_forward`` pairs."""

    def batch(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[BatchT, int]:
        """The objective's batch of these pairs (the current policy's predictions with gradient), its NFE."""

    def deviation(self, batch: BatchT) -> torch.Tensor | None:
        """The batch's largest departure from the sampling policy (|ratio - 1|, or the relative
        velocity difference to the old policy); None when there is nothing to compare with."""

    def levels(self, made: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The noise level of each (item, unit) pair of a pass: which of the policy's forward groups
        runs it (:mod:`fgrpo.core.points.lockstep`)."""

    def idle(self, count: int, level: float | None = None) -> None:
        """``count`` forward/backward passes that change no gradient (padding for the launch), at
        noise level ``level`` (None: any)."""


#: the points of each kind of objective (``Objective.trains_on``)
KINDS = {"transitions": Transitions, "forward": ForwardPoints}


def training_points(run: Run, traj: Trajectory, adv: torch.Tensor, iteration: int) -> TrainingPoints:
    """What the run's objective trains on, for this iteration's rollout and advantages."""
    return KINDS[run.objective.trains_on](run, traj, adv, iteration)


__all__ = ["KINDS", "ForwardPoints", "TrainingPoints", "Transitions", "training_points"]
