"""The state of one training run, typed by the protocols its components satisfy.

A :class:`Run` holds the recipe, the components it composed, the :class:`Learner` (what the update
changes: the policy's trained weights, their optimizer, the EMA, the objective's old policy, and
the launch that spreads them over processes) and the :class:`RunIO` (where the run's results go:
its folder, metrics log, display and time accounting). :func:`fgrpo.core.building.build_run`
makes it from a recipe; every step of an iteration (:mod:`fgrpo.core.rollout`,
:mod:`fgrpo.core.update`) takes it, so a reader can follow ``run.sampler.rollout`` to
:class:`~fgrpo.core.protocols.Sampler`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from fgrpo.core.data import PromptSchedule
from fgrpo.core.ema import EMA
from fgrpo.core.guard import Guard
from fgrpo.core.launch import Launch
from fgrpo.core.protocols import AnyObjective, Policy, PromptSource, Reward, Sampler
from fgrpo.core.recipe import EvaluatorSpec, Recipe, RewardSpec
from fgrpo.core.rundir import RunFolder
from fgrpo.core.runlog import Display, MetricsLog
from fgrpo.core.timing import Clock

if TYPE_CHECKING:
    from accelerate import Accelerator


@attrs.define
class Learner:
    """What the update changes, and the launch that spreads it over the processes."""

    policy: Policy
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    launch: Launch  # the launch kind: backward, optimizer step, padding, checkpoint state (fgrpo.core.launch)
    ema: EMA | None = None
    old_policy: EMA | None = None  # the objective's old policy (Objective.old_decay): lagged trainable weights
    optimizer_steps: int = 0  # over the whole run (checkpointed): the EMA counts these


@attrs.define
class RunIO:
    """Where a run's results go (the trackers are accelerate's, on the launch's Accelerator)."""

    display: Display
    clock: Clock  # time accounting per iteration
    out_dir: Path | None = None
    folder: RunFolder | None = None  # the locked run folder (main process of a compose)
    log: MetricsLog | None = None
    report: Path | None = None  # report.html, once the run has written it


@attrs.define
class Run:
    recipe: Recipe
    learner: Learner
    io: RunIO
    sampler: Sampler
    objective: AnyObjective
    prompts: PromptSource
    rewards: list[tuple[RewardSpec, Reward]]
    schedule: PromptSchedule
    evaluators: list[tuple[EvaluatorSpec, Any]] = attrs.Factory(list)  # gold metrics (fgrpo.core.protocols.Evaluator)
    guard: Guard | None = None  # eval.guard: the proxy rises while a gold metric falls
    start_iteration: int = 0  # iterations already done (after a resume)
    saved_at: int | None = None  # the iteration of the checkpoint written last (one per iteration)
    checking: bool = False  # ``fgrpo check``: the update also measures the old policy's predictions

    @property
    def accelerator(self) -> Accelerator:
        """accelerate's Accelerator: autocast, gather, trackers (what every launch kind does alike)."""
        return self.learner.launch.accelerator

    @property
    def is_main(self) -> bool:
        return self.learner.launch.is_main
