"""``full``: every step uses the stochastic kernel (classic Flow-GRPO and DanceGRPO).

All ``steps`` are sampled with the kernel; the trained steps are the first
``int(steps * timestep_fraction)`` steps whose std is positive, in order (flow_grpo: 10 steps with
the default fraction 0.99 train steps 0-8: the last step, to sigma' = 0, is a very sharp Gaussian
and is left out on purpose), or with ``random_subset`` that many steps drawn at random for each
sample (DanceGRPO). A step whose std is 0 (``cps`` stepping to sigma' = 0) is sampled but never
trained. ``final`` chooses the decoded image (see :func:`fgrpo.samplers.base.final_param`); with ``final: ode``
the last step is a deterministic Euler step and is never trained.

``step_index`` is (B, S): the same row for every sample, or with ``random_subset`` a different
ascending row per sample (DanceGRPO draws a permutation per sample). The trainer must therefore
pass ``step_index[:, j]`` (a (B,) tensor) as the kernel's ``index`` when it re-evaluates step j.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fgrpo.core.config import ConfigError, param
from fgrpo.core.registry import component
from fgrpo.samplers.base import GroupSampler, Plan, Step, final_param, key, schedule_param


@attrs.define
class FullSampler(GroupSampler):
    """Every step stochastic, the first ``int(steps * timestep_fraction)`` (or a random subset of that
    size) trained: Flow-GRPO and DanceGRPO (see the module docstring)."""

    steps: int = param(10, ge=1, help="sampling steps")
    timestep_fraction: float = param(
        0.99, gt=0.0, le=1.0, help="train the first int(steps * fraction) steps (flow_grpo 0.99, DanceGRPO 0.6)"
    )
    random_subset: bool = param(
        False, help="DanceGRPO: train a random subset of that size, drawn per sample, instead of the first steps"
    )
    share_noise: bool = param(
        False, help="the G samples of a prompt start from the same initial noise (DanceGRPO: true)"
    )
    schedule: dict | None = schedule_param()
    final: str | None = final_param()
    kernel: Any = component("kernel", default="sde", help="the stochastic kernel of every step")

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        errors = super().check_keys(keys, prefix)
        if "steps" not in keys or "timestep_fraction" not in keys:
            return errors
        steps, fraction = keys["steps"], keys["timestep_fraction"]
        if int(steps * fraction) >= 1:
            return errors
        return errors + [
            ConfigError(
                key(prefix, "timestep_fraction"),
                f"got {fraction!r}: int({steps} * {fraction!r}) = 0 trained steps; "
                f"allowed: >= {1 / steps:g} for {steps} steps",
            )
        ]

    @property
    def num_trained(self) -> int:
        return int(self.steps * self.timestep_fraction)

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        return Plan([Step(self.kernel, sigmas, i, "sde") for i in range(self.steps)], phases=("sde",))

    def trained_steps(self, candidates: list[int], batch: int, generator: torch.Generator | None) -> torch.Tensor:
        count = min(self.num_trained, len(candidates))
        pool = torch.tensor(candidates, dtype=torch.long)
        if not self.random_subset:
            return pool[:count].expand(batch, count).clone()
        device = generator.device if generator is not None else torch.device("cpu")
        keys = torch.rand((batch, len(candidates)), generator=generator, device=device).cpu()
        return pool[keys.argsort(dim=1)[:, :count]].sort(dim=1).values
