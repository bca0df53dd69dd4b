"""``fast`` (Flow-GRPO-Fast): a short stochastic window at a random start, ODE elsewhere.

Per rollout, one window start ``k`` is drawn uniformly from ``window_start_range`` ([low, high),
default [0, steps // 2)) with the rollout's generator, before anything else is drawn. Steps
``k .. k + window - 1`` use the stochastic kernel and are trained; every other step is an Euler
ODE step (kernel ``ode``). ``step_index`` is (B, window), the same row for every sample.

The G samples of a prompt share their initial noise (drawn once per prompt and repeated, as
flow_grpo Fast and DanceGRPO do), so the ODE prefix 0 .. k - 1 is the same for the whole group.
With ``share_prefix`` (the default) it is computed ONCE per prompt (batch = number of prompts) and
the latents branch into G samples at the window start; with ``share_prefix: false`` it is
recomputed for every sample (the reference behaviour). Both give the same trajectories for the
same generator seed (bit-identical when the network's rows do not depend on the batch size), and
the shared prefix saves ``k * (G - 1) * prompts * evaluations_per_call`` network evaluations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fgrpo.core.config import ConfigError, component, param
from fgrpo.core.protocols import Policy, Trajectory
from fgrpo.samplers import _rollout


@attrs.define
class FastSampler:
    steps: int = param(10, ge=1, help="sampling steps")
    window: int = param(2, ge=1, help="consecutive stochastic (trained) steps")
    window_start_range: list[int] | None = param(
        None,
        help="[low, high): the window start is drawn uniformly from it; "
        "null = [0, steps // 2) (cut so that the window fits)",
    )
    share_prefix: bool = param(True, help="compute the ODE prefix once per prompt, not once per sample")
    schedule: dict | None = param(
        None,
        validator=_rollout.check_schedule,
        help="null: the model's own sigmas; else a schedule mapping, e.g. {type: shift, shift: 3.0}",
    )
    kernel: Any = component("kernel", default="sde", help="the stochastic kernel of the window")
    _ode: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        _rollout.raise_errors(self.check_keys(_rollout.field_values(self)))

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        """The errors that involve several keys (each key's own checks are its field's).

        ``keys``: the recipe keys after the per-key checks (absent keys are not checked here).
        """
        errors = [_rollout.kernel_error(keys["kernel"], prefix)] if "kernel" in keys else []
        if "steps" not in keys or "window" not in keys:
            return [e for e in errors if e is not None]
        steps, window = keys["steps"], keys["window"]
        if window > steps:
            errors.append(ConfigError(_rollout.key(prefix, "window"), f"got {window}; allowed: <= steps ({steps})"))
        elif keys.get("window_start_range") is not None:
            given = list(keys["window_start_range"])
            last = steps - window
            if len(given) != 2 or not 0 <= given[0] < given[1] <= last + 1:
                errors.append(
                    ConfigError(
                        _rollout.key(prefix, "window_start_range"),
                        f"got {given!r}; allowed: [low, high) with 0 <= low < high <= {last + 1} "
                        f"(the window of {window} must fit in {steps} steps)",
                    )
                )
        return [e for e in errors if e is not None]

    @property
    def start_range(self) -> tuple[int, int]:
        """[low, high) of the window start."""
        if self.window_start_range is None:
            return 0, max(min(self.steps // 2, self.steps - self.window + 1), 1)
        low, high = self.window_start_range
        return int(low), int(high)

    def rollout(
        self,
        policy: Policy,
        prompts: Sequence[str],
        group_size: int,
        *,
        generator: torch.Generator | None = None,
    ) -> Trajectory:
        start = _rollout.randint(*self.start_range, generator)
        sigmas = _rollout.main_sigmas(policy, self.steps, self.schedule)
        window = list(range(start, start + self.window))
        trained = _rollout.trainable(self.kernel, sigmas, window)
        if not trained:
            raise ValueError(f"the kernel has std 0 on the whole window {window} of {sigmas.tolist()}")
        if self._ode is None:
            self._ode = _rollout.builtin_kernel("ode")
        program = []
        for i in range(self.steps):
            if i < start:
                program.append(_rollout.Step(self._ode, sigmas, i, "prefix"))
            elif i in window:
                program.append(_rollout.Step(self.kernel, sigmas, i, "window"))
            else:
                program.append(_rollout.Step(self._ode, sigmas, i, "suffix"))
        batch = len(prompts) * group_size
        return _rollout.run(
            policy,
            prompts,
            group_size,
            program=program,
            sigmas=sigmas,
            trained=torch.tensor(trained, dtype=torch.long).expand(batch, len(trained)).clone(),
            share_noise=True,
            prefix=start if self.share_prefix else 0,
            generator=generator,
            phases=("prefix", "window", "suffix"),
            info={"window_start": start, "window": window},
        )

    def advance(self, iteration: int) -> None:
        """The window start is drawn per rollout; nothing moves between iterations."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass
