"""``full``: every step uses the stochastic kernel (classic Flow-GRPO and DanceGRPO).

All ``steps`` are sampled with the kernel; the trained steps are the first
``int(steps * timestep_fraction)`` steps whose std is positive, in order (flow_grpo: 10 steps with
the default fraction 0.99 train steps 0-8: the last step, to sigma' = 0, is a very sharp Gaussian
and is left out on purpose), or with ``random_subset`` that many steps drawn at random for each
sample (DanceGRPO). A step whose std is 0 (``cps`` stepping to sigma' = 0) is sampled but never
trained. ``final`` chooses the decoded image (see ``_rollout.final_param``); with ``final: ode``
the last step is a deterministic Euler step and is never trained.

``step_index`` is (B, S): the same row for every sample, or with ``random_subset`` a different
ascending row per sample (DanceGRPO draws a permutation per sample). The trainer must therefore
pass ``step_index[:, j]`` (a (B,) tensor) as the kernel's ``index`` when it re-evaluates step j.
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
class FullSampler:
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
    schedule: dict | None = param(
        None,
        validator=_rollout.check_schedule,
        help="null: the model's own sigmas; else a schedule mapping, e.g. {type: shift, shift: 3.0}",
    )
    final: str | None = _rollout.final_param()
    kernel: Any = component("kernel", default="sde", help="the stochastic kernel of every step")
    _ode: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        _rollout.raise_errors(self.check_keys(_rollout.field_values(self)))

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        """The errors that involve several keys (each key's own checks are its field's).

        ``keys``: the recipe keys after the per-key checks (absent keys are not checked here).
        """
        errors = [_rollout.kernel_error(keys["kernel"], prefix)] if "kernel" in keys else []
        if "steps" in keys and "timestep_fraction" in keys:
            steps, fraction = keys["steps"], keys["timestep_fraction"]
            if int(steps * fraction) < 1:
                errors.append(
                    ConfigError(
                        _rollout.key(prefix, "timestep_fraction"),
                        f"got {fraction!r}: int({steps} * {fraction!r}) = 0 trained steps; "
                        f"allowed: >= {1 / steps:g} for {steps} steps",
                    )
                )
        return [e for e in errors if e is not None]

    def sigmas(self, policy: Policy, steps: int) -> torch.Tensor:
        """This sampler's schedule with ``steps`` steps (evaluation integrates on it)."""
        return _rollout.main_sigmas(policy, steps, self.schedule)

    @property
    def num_trained(self) -> int:
        return int(self.steps * self.timestep_fraction)

    def rollout(
        self,
        policy: Policy,
        prompts: Sequence[str],
        group_size: int,
        *,
        generator: torch.Generator | None = None,
    ) -> Trajectory:
        sigmas = _rollout.main_sigmas(policy, self.steps, self.schedule)
        final = _rollout.resolve_final(self.final, self.kernel)
        if self._ode is None:
            self._ode = _rollout.builtin_kernel("ode")
        program = [_rollout.Step(self.kernel, sigmas, i, "sde") for i in range(self.steps)]
        program = _rollout.with_final(program, final, self._ode)
        candidates = _rollout.trainable(self.kernel, sigmas, _rollout.stochastic_steps(program, self.kernel))
        if not candidates:
            raise ValueError(f"the kernel has std 0 at every step of {sigmas.tolist()}: nothing to train")
        count = min(self.num_trained, len(candidates))
        batch = len(prompts) * group_size
        pool = torch.tensor(candidates, dtype=torch.long)
        if self.random_subset:
            device = generator.device if generator is not None else torch.device("cpu")
            keys = torch.rand((batch, len(candidates)), generator=generator, device=device).cpu()
            trained = pool[keys.argsort(dim=1)[:, :count]].sort(dim=1).values
        else:
            trained = pool[:count].expand(batch, count).clone()
        return _rollout.run(
            policy,
            prompts,
            group_size,
            program=program,
            sigmas=sigmas,
            trained=trained,
            share_noise=self.share_noise,
            generator=generator,
            phases=("sde",),
            final=final,
        )

    def advance(self, iteration: int) -> None:
        """Nothing moves between iterations."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass
