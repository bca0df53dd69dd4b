"""``ode``: deterministic rollouts for the objectives that train on the forward process.

Every step is the deterministic ``kernel`` (``euler``, ``dpmpp2m``, ``dpmpp3m``; any other
kernel with ``stochastic = False``) on the sampler's schedule, at any step count, with the
model's own classifier-free guidance if it has one. Nothing but the final samples and their
conditioning is kept: the trajectory has no trained steps (S = 0), since nft, awm and dpo re-noise
the finished sample instead of re-evaluating transitions (DiffusionNFT's rollouts use DPM-Solver
2, its ``sample.solver: dpm2``). A recipe that pairs this sampler with grpo or grpo-guard, which
train on stochastic transitions, is refused when it is validated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core import registry
from fgrpo.core.config import ConfigError, param
from fgrpo.core.registry import component
from fgrpo.samplers.base import GroupSampler, Plan, Step, key, schedule_param


@attrs.define
class ODESampler(GroupSampler):
    """Deterministic solver rollouts with no trained steps: the final samples only (see the module
    docstring)."""

    steps: int = param(10, ge=1, help="solver steps")
    share_noise: bool = param(
        False,
        help="the G samples of a prompt start from the same initial noise (then they are identical: a deterministic "
        "solver)",
    )
    schedule: dict | None = schedule_param()
    kernel: Any = component("kernel", default="euler", help="the deterministic solver: euler, dpmpp2m, dpmpp3m")

    # the state after the last step (a deterministic step: x0 at sigma' = 0); fixed here, a recipe key elsewhere
    final: ClassVar[str] = "sample"  # type: ignore[misc]
    #: the rollout records no stochastic transitions (objectives that need them refuse this sampler)
    transitions: ClassVar[bool] = False

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        spec = keys.get("kernel")
        name = spec if isinstance(spec, str) else spec.get("name") if isinstance(spec, Mapping) else None
        target = spec
        if name is not None:
            try:
                target = registry.load("kernel", str(name))
            except registry.ComponentError:
                return []  # reported by the registry's own check of the kernel key
        if spec is not None and getattr(target, "stochastic", False):
            shown_name = name if name is not None else type(spec).__name__
            return [
                ConfigError(
                    key(prefix, "kernel"),
                    f"got the stochastic kernel {shown_name!r}; the ode sampler takes deterministic steps only "
                    "(euler, dpmpp2m, dpmpp3m); stochastic windows are the full, fast and mixgrpo samplers'",
                )
            ]
        return []

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        return Plan([Step(self.kernel, sigmas, i, "ode") for i in range(self.steps)], phases=("ode",))
