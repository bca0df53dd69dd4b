"""``full``: every step uses the stochastic kernel (classic Flow-GRPO and DanceGRPO).

All ``steps`` are sampled with the kernel; the trained steps are the first
``int(steps * timestep_fraction)`` steps whose std is positive, in order (flow_grpo: 10 steps with
the default fraction 0.99 train steps 0-8: the last step, to sigma' = 0, is a very sharp Gaussian
and is left out on purpose), or with ``random_subset`` that many steps drawn at random for each
sample (DanceGRPO). A step whose std is 0 (``cps`` stepping to sigma' = 0) is sampled but never
trained. ``final`` chooses the decoded image (see :func:`fgrpo.samplers.base.final_param`); with ``final: ode``
the last step is a deterministic Euler step and is never trained.

``ignore_last`` (DanceGRPO's and Pref-GRPO's trainers, which slice the last step off the rollout
before they take the fraction: ``samples["timesteps"][:, :-1]``, ``int(24 * 0.6) = 14`` of 25 steps)
leaves the last step out of the trained pool and counts the fraction over the other
``steps - 1``: ``int((steps - 1) * timestep_fraction)`` steps drawn from steps 0 .. steps - 2. The
last step is still sampled with the kernel (its sample is decoded with ``final: sample``; the
references decode its predicted x0, ``final: x0``).

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
    ignore_last: bool = param(
        False,
        help="never train the last step and take the fraction of the other steps - 1: int((steps - 1) * fraction) "
        "(DanceGRPO, Pref-GRPO)",
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
        pool = steps - 1 if keys.get("ignore_last") else steps
        if pool < 1:
            return errors + [
                ConfigError(
                    key(prefix, "ignore_last"),
                    f"got true with steps {steps}: the last step is the only one, nothing is left to train; "
                    "allowed: false, or steps >= 2",
                )
            ]
        if int(pool * fraction) >= 1:
            return errors
        return errors + [
            ConfigError(
                key(prefix, "timestep_fraction"),
                f"got {fraction!r}: int({pool} * {fraction!r}) = 0 trained steps; "
                f"allowed: >= {1 / pool:g} for {pool} trainable steps",
            )
        ]

    @property
    def num_trained(self) -> int:
        """How many steps each sample trains (before steps with std 0 are left out)."""
        return int(self.trainable_pool * self.timestep_fraction)

    @property
    def trainable_pool(self) -> int:
        """The steps the fraction is taken of: all, or all but the last with ``ignore_last``."""
        return self.steps - 1 if self.ignore_last else self.steps

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        return Plan([Step(self.kernel, sigmas, i, "sde") for i in range(self.steps)], phases=("sde",))

    def trained_steps(self, candidates: list[int], batch: int, generator: torch.Generator | None) -> torch.Tensor:
        if self.ignore_last:
            candidates = [p for p in candidates if p < self.steps - 1]
        count = min(self.num_trained, len(candidates))
        pool = torch.tensor(candidates, dtype=torch.long)
        if not self.random_subset:
            return pool[:count].expand(batch, count).clone()
        device = generator.device if generator is not None else torch.device("cpu")
        keys = torch.rand((batch, len(candidates)), generator=generator, device=device).cpu()
        return pool[keys.argsort(dim=1)[:, :count]].sort(dim=1).values
