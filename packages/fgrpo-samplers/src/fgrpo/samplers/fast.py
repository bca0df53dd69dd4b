"""``fast`` (Flow-GRPO-Fast): a short stochastic window at a random start, ODE elsewhere.

Per rollout, one window of ``window`` consecutive steps is placed uniformly at random inside
``window_range`` = [low, high] (flow_grpo's ``sde_window_range``: the whole window lies in steps
low .. high - 1, its start is drawn from low .. high - window inclusive, as flow_grpo's
``random.randint(low, high - window)``; default [0, steps // 2], flow_grpo's Fast configs), with
the rollout's generator, before anything else is drawn. The window's steps use the stochastic
kernel and are trained; every other step is an Euler ODE step (kernel ``ode``). ``step_index`` is
(B, window), the same row for every sample.

Initial noise (flow_grpo ``same_latent``): with ``share_noise`` the G samples of a prompt start
from the same noise (drawn once per prompt and repeated), so the ODE prefix 0 .. k - 1 is the same
for the whole group. With ``share_prefix`` it is then computed ONCE per prompt (batch = number of
prompts) and the latents branch into G samples at the window start; with ``share_prefix: false``
it is recomputed for every sample (the reference behaviour). Both give the same trajectories for
the same generator seed (bit-identical when the network's rows do not depend on the batch size),
and the shared prefix saves ``k * (G - 1) * prompts * evaluations_per_call`` network
evaluations. With ``share_noise: false`` (flow_grpo's default) every sample has its own noise and
its own prefix.
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
    window_range: list[int] | None = param(
        None,
        help="[low, high]: the window lies inside steps low .. high - 1, its start drawn uniformly "
        "from low .. high - window (flow_grpo sde_window_range); null = [0, steps // 2] (at least the window)",
    )
    share_noise: bool = param(
        True, help="the G samples of a prompt start from the same initial noise (flow_grpo same_latent)"
    )
    share_prefix: bool = param(
        True, help="with share_noise: compute the ODE prefix once per prompt, not once per sample"
    )
    schedule: dict | None = param(
        None,
        validator=_rollout.check_schedule,
        help="null: the model's own sigmas; else a schedule mapping, e.g. {type: shift, shift: 3.0}",
    )
    final: str | None = _rollout.final_param()
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
        elif keys.get("window_range") is not None:
            given = list(keys["window_range"])
            if len(given) != 2 or not 0 <= given[0] <= given[1] - window or given[1] > steps:
                errors.append(
                    ConfigError(
                        _rollout.key(prefix, "window_range"),
                        f"got {given!r}; allowed: [low, high] with 0 <= low, low + window ({window}) <= high "
                        f"<= steps ({steps}): the window must fit inside it",
                    )
                )
        return [e for e in errors if e is not None]

    def sigmas(self, policy: Policy, steps: int) -> torch.Tensor:
        """This sampler's schedule with ``steps`` steps (evaluation integrates on it)."""
        return _rollout.main_sigmas(policy, steps, self.schedule)

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

    def rollout(
        self,
        policy: Policy,
        prompts: Sequence[str],
        group_size: int,
        *,
        generator: torch.Generator | None = None,
    ) -> Trajectory:
        first, last = self.start_range
        start = _rollout.randint(first, last + 1, generator)
        sigmas = _rollout.main_sigmas(policy, self.steps, self.schedule)
        window = list(range(start, start + self.window))
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
        final = _rollout.resolve_final(self.final, self.kernel)
        program = _rollout.with_final(program, final, self._ode)
        trained = _rollout.trainable(self.kernel, sigmas, _rollout.stochastic_steps(program, self.kernel))
        if not trained:
            raise ValueError(f"the kernel has std 0 on the whole window {window} of {sigmas.tolist()}")
        batch = len(prompts) * group_size
        return _rollout.run(
            policy,
            prompts,
            group_size,
            program=program,
            sigmas=sigmas,
            trained=torch.tensor(trained, dtype=torch.long).expand(batch, len(trained)).clone(),
            share_noise=self.share_noise,
            prefix=start if (self.share_noise and self.share_prefix) else 0,
            generator=generator,
            phases=("prefix", "window", "suffix"),
            info={"window_start": start, "window": window},
            final=final,
        )

    def advance(self, iteration: int) -> None:
        """The window start is drawn per rollout; nothing moves between iterations."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass
