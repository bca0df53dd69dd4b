"""``flash`` (Flash-GRPO): ONE stochastic, trained step per sample, Euler ODE steps elsewhere.

As the reference (Shredded-Pork/Flash-GRPO @ 4211013, ``scripts/train_wanx2_1_flash.py``
693-706 and ``flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob_sample.py`` 276-350): each
rollout draws one step index k uniformly from ``step_range`` = [low, high) (default
[0, steps // 2]: the reference draws from the first 10 of its 20 steps), with the rollout's
generator before anything else, so it is seeded and resumes bit-exactly. Step k uses the
stochastic kernel and is the only recorded (trained) transition, ``step_index`` (B, 1) with the
same k for every sample of the rollout ("iso-temporal grouping": the samples a group is compared
within share the step); every other step is an Euler step x + dt v. The reference draws k per
prompt with each rollout call holding one prompt: ``train.rollout_prompts: 1`` does the same, a
larger chunk shares k among its prompts (docs/method.md). Each sample starts from its own noise,
as the reference; with ``share_noise`` the G samples of a prompt share it and the ODE prefix
0 .. k - 1 runs once per prompt. The reference's kernel is ``wan-sde`` (its Wan SDE step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core.config import ConfigError, param
from fgrpo.core.registry import component
from fgrpo.samplers.base import (
    EULER,
    GroupSampler,
    Plan,
    Step,
    drawn_range,
    final_param,
    kl_steps_param,
    randint,
    schedule_param,
    step_range_errors,
)


@attrs.define
class FlashSampler(GroupSampler):
    """Flash-GRPO: one stochastic, trained step at a random index in ``step_range``, Euler steps
    elsewhere (see the module docstring)."""

    steps: int = param(10, ge=1, help="sampling steps")
    step_range: list[int] | None = param(
        None,
        help="[low, high]: the stochastic step is drawn uniformly from low .. high - 1; null = [0, steps // 2] "
        "(at least one step; the reference: the first 10 of 20)",
    )
    share_noise: bool = param(False, help="the G samples of a prompt start from the same noise (the reference: false)")
    kl_steps: str = kl_steps_param()
    schedule: dict | None = schedule_param()
    final: str | None = final_param()
    kernel: Any = component("kernel", default="wan-sde", help="the stochastic kernel of the one trained step")

    nothing_to_train: ClassVar[str] = "the kernel has std 0 at the drawn step {flash_step} of {sigmas}"

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        return super().check_keys(keys, prefix) + step_range_errors(keys, prefix, "step_range")

    @property
    def bounds(self) -> tuple[int, int]:
        """[low, high): the stochastic step's candidates."""
        return drawn_range(self.step_range, (0, max(self.steps // 2, 1)))

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        low, high = self.bounds
        k = randint(low, high, generator)
        steps = [
            Step(self.kernel, sigmas, i, "flash")
            if i == k
            else Step(EULER, sigmas, i, "prefix" if i < k else "suffix")
            for i in range(self.steps)
        ]
        return Plan(
            steps, prefix=k if self.share_noise else 0, phases=("prefix", "flash", "suffix"), info={"flash_step": k}
        )
