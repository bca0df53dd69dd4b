"""The state of one training run, typed by the protocols its components satisfy.

``trainer.build_run`` makes it from a recipe; every phase of an iteration (``fgrpo.core.phases``)
takes it, so a reader can follow ``run.sampler.rollout`` to :class:`~fgrpo.core.protocols.Sampler`.
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
from fgrpo.core.protocols import Objective, Policy, PromptSource, Reward, Sampler
from fgrpo.core.recipe import EvaluatorSpec, Recipe, RewardSpec
from fgrpo.core.rundir import RunFolder
from fgrpo.core.runlog import Display, MetricsLog
from fgrpo.core.timing import Clock

if TYPE_CHECKING:
    from accelerate import Accelerator


@attrs.define
class Run:
    recipe: Recipe
    policy: Policy
    sampler: Sampler
    objective: Objective
    prompts: PromptSource
    rewards: list[tuple[RewardSpec, Reward]]
    parallel: Launch  # the launch kind: backward, optimizer step, padding, checkpoint state (fgrpo.core.launch)
    trainable: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: EMA | None
    schedule: PromptSchedule
    display: Display
    out_dir: Path | None = None
    log: MetricsLog | None = None
    folder: RunFolder | None = None  # the locked run folder (main process of a compose)
    start_iteration: int = 0  # iterations already done (after a resume)
    optimizer_steps: int = 0  # over the whole run (checkpointed): the EMA counts these
    old: EMA | None = None  # the objective's old policy (Objective.old_decay), a lagged copy of the trainable weights
    checking: bool = False  # ``fgrpo check``: the update also measures the old policy's predictions
    clock: Clock = attrs.Factory(lambda self: Clock(self.policy.device), takes_self=True)  # time accounting
    evaluators: list[tuple[EvaluatorSpec, Any]] = attrs.Factory(list)  # gold metrics (fgrpo.core.protocols.Evaluator)
    guard: Guard | None = None  # eval.guard: the proxy rises while a gold metric falls
    saved_at: int | None = None  # the iteration of the checkpoint written last (one per iteration)

    @property
    def accelerator(self) -> Accelerator:
        """accelerate's Accelerator: autocast, gather, trackers (what every launch kind does alike)."""
        return self.parallel.accelerator

    @property
    def is_main(self) -> bool:
        return self.parallel.is_main
