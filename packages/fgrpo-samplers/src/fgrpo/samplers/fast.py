"""``fast`` (Flow-GRPO-Fast): a short stochastic window at a random start, ODE elsewhere.

Per rollout, one window of ``window`` consecutive steps is placed uniformly at random inside
``window_range`` = [low, high] (flow_grpo's ``sde_window_range``: the whole window lies in steps
low .. high - 1, its start is drawn from low .. high - window inclusive, as flow_grpo's
``random.randint(low, high - window)``; default [0, steps // 2], flow_grpo's Fast configs), with
the rollout's generator, before anything else is drawn. The window's steps use the stochastic
kernel and are trained; every other step is an Euler ODE step (kernel ``ode``). ``step_index`` is
(B, window), the same row for every sample.

Initial noise (flow_grpo ``same_latent``): by default every sample has its own initial noise, as
in flow_grpo (on the shapes world a shared start left 35-48% of the groups flat against 8-20%,
and learned less; docs/method.md). With ``share_noise`` the G samples of a prompt start from the
same noise (drawn once per prompt and repeated), so the ODE prefix 0 .. k - 1 is the same for the
whole group. With ``share_prefix`` it is then computed ONCE per prompt (batch = number of
prompts) and the latents branch into G samples at the window start; with ``share_prefix: false``
it is recomputed for every sample (the reference behaviour). Both give the same trajectories for
the same generator seed (bit-identical when the network's rows do not depend on the batch size),
and the shared prefix saves ``k * (G - 1) * prompts * evaluations_per_call`` network
evaluations.
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
    final_param,
    key,
    kl_steps_param,
    randint,
    schedule_param,
)


@attrs.define
class FastSampler(GroupSampler):
    """Flow-GRPO-Fast: a window of ``window`` stochastic, trained steps at a random start, Euler
    steps elsewhere; each sample its own initial noise unless ``share_noise`` (see the module docstring)."""

    steps: int = param(10, ge=1, help="sampling steps")
    window: int = param(2, ge=1, help="consecutive stochastic (trained) steps")
    window_range: list[int] | None = param(
        None,
        help="[low, high]: the window lies inside steps low .. high - 1, its start drawn uniformly "
        "from low .. high - window (flow_grpo sde_window_range); null = [0, steps // 2] (at least the window)",
    )
    share_noise: bool = param(
        False,
        help="the G samples of a prompt start from the same initial noise (flow_grpo same_latent, default "
        "false: a shared start leaves only the window to spread a group, and many more groups flat)",
    )
    share_prefix: bool = param(
        True, help="with share_noise: compute the ODE prefix once per prompt, not once per sample"
    )
    kl_steps: str = kl_steps_param()
    schedule: dict | None = schedule_param()
    final: str | None = final_param()
    kernel: Any = component("kernel", default="sde", help="the stochastic kernel of the window")

    nothing_to_train: ClassVar[str] = "the kernel has std 0 on the whole window {window} of {sigmas}"

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        errors = super().check_keys(keys, prefix)
        if "steps" not in keys or "window" not in keys:
            return errors
        steps, window = keys["steps"], keys["window"]
        if window > steps:
            return errors + [ConfigError(key(prefix, "window"), f"got {window}; allowed: <= steps ({steps})")]
        given = keys.get("window_range")
        if given is not None and (len(given) != 2 or not 0 <= given[0] <= given[1] - window or given[1] > steps):
            return errors + [
                ConfigError(
                    key(prefix, "window_range"),
                    f"got {list(given)!r}; allowed: [low, high] with 0 <= low, low + window ({window}) <= high "
                    f"<= steps ({steps}): the window must fit inside it",
                )
            ]
        return errors

    @property
    def bounds(self) -> tuple[int, int]:
        """[low, high]: the window lies inside steps low .. high - 1."""
        if self.window_range is None:
            return 0, max(self.steps // 2, self.window)
        low, high = self.window_range
        return int(low), int(high)

    @property
    def start_range(self) -> tuple[int, int]:
        """[first, last] window starts (inclusive)."""
        low, high = self.bounds
        return low, high - self.window

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        first, last = self.start_range
        start = randint(first, last + 1, generator)
        window = range(start, start + self.window)
        steps = [
            Step(self.kernel, sigmas, i, "window")
            if i in window
            else Step(EULER, sigmas, i, "prefix" if i < start else "suffix")
            for i in range(self.steps)
        ]
        return Plan(
            steps,
            prefix=start if (self.share_noise and self.share_prefix) else 0,
            phases=("prefix", "window", "suffix"),
            info={"window_start": start, "window": list(window)},
        )
