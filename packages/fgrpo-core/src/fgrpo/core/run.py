"""The state of one training run, typed by the protocols its components satisfy.

``trainer.build_run`` makes it from a recipe; every phase of an iteration (``fgrpo.core.phases``)
takes it, so a reader can follow ``run.sampler.rollout`` to :class:`~fgrpo.core.protocols.Sampler`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from fgrpo.core.data import PromptSchedule
from fgrpo.core.ema import EMA
from fgrpo.core.protocols import Objective, Policy, PromptSource, Reward, Sampler
from fgrpo.core.recipe import Recipe, RewardSpec
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
    accelerator: Accelerator
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

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def sharded(self) -> bool:
        """The training state is split over the processes (FSDP or DeepSpeed ZeRO-2,
        :mod:`fgrpo.core.sharding`): every backward and every checkpoint involves every process."""
        from fgrpo.core.sharding import is_sharded

        return is_sharded(self.accelerator)

    @property
    def sharded_weights(self) -> bool:
        """The weights themselves are split (FSDP): every forward involves every process."""
        from fgrpo.core.sharding import shards_weights

        return shards_weights(self.accelerator)
