"""``sparse`` (UniRL's ``AllSDEScheduler`` with ``num_sde_steps``): a few stochastic, trained steps
drawn once per iteration for the whole batch, Euler ODE steps elsewhere.

As the reference (Tencent-Hunyuan/UniRL @ 1a7b501, ``unirl/utils/scheduler_utils.py`` 86-124,
``unirl/types/sampling.py`` 110-128, ``unirl/trainer/diffusion.py`` 241-255 and
``unirl/models/hunyuan_video15/diffusion.py`` 513-531): at the start of every iteration
(:meth:`SparseSampler.advance`) ``trained`` distinct steps are drawn without replacement from
``step_range`` = [low, high) (UniRL's ``timestep_fraction`` [f0, f1] is [int(steps f0),
int(steps f1)): 16 steps and [0.0, 0.6] give [0, 9)) by ``numpy.random.default_rng(iteration)
.choice(pool, trained, replace=False)``, the very call UniRL makes with its ``rollout_id`` (the
0-based iteration), and sorted. Those steps take the stochastic kernel and are all trained, the
same for every sample and every process of the iteration (the draw is a pure function of the
iteration, so a resumed run draws what the uninterrupted one drew); every other step is an Euler
step x + dt v (UniRL's ``eta`` 0 outside the drawn set: its Flow-SDE step with std 0). A draw
seeded by the iteration alone is the same in every run, whatever ``seed:`` says (as UniRL's);
``seed`` set here keys it by (seed, iteration) instead. ``trained: null`` (or at least the range's
size) takes every step of the range, as UniRL's ``num_sde_steps: null``.

Initial noise: each sample its own (UniRL ``init_same_noise: false``); with ``share_noise`` the G
samples of a prompt share it and the ODE prefix before the first drawn step runs once per prompt.

State (``state_dict``): ``{"iteration": int, "drawn": [the drawn steps]}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import numpy as np
import torch

from fgrpo.core.config import ConfigError, param
from fgrpo.core.registry import component
from fgrpo.core.seeding import derive_seed
from fgrpo.samplers.base import (
    EULER,
    GroupSampler,
    Plan,
    Step,
    drawn_range,
    final_param,
    key,
    kl_steps_param,
    schedule_param,
    step_range_errors,
)


def draw_steps(low: int, high: int, count: int | None, iteration: int, seed: int | None = None) -> list[int]:
    """The steps drawn at ``iteration``: ``count`` of low .. high - 1 without replacement, sorted
    (all of them when ``count`` is null or not smaller than the range). Seeded by the iteration
    alone (UniRL's ``np.random.default_rng(rollout_id)``) or, with ``seed``, by (seed, iteration)."""
    pool = list(range(low, high))
    if count is None or count >= len(pool):
        return pool
    rng = np.random.default_rng(int(iteration) if seed is None else derive_seed(seed, "sparse-steps", iteration))
    return sorted(int(i) for i in rng.choice(pool, size=count, replace=False))


@attrs.define
class SparseSampler(GroupSampler):
    """UniRL's sparse SDE steps: ``trained`` stochastic, trained steps drawn once per iteration from
    ``step_range`` for the whole batch, Euler steps elsewhere (see the module docstring)."""

    steps: int = param(10, ge=1, help="sampling steps")
    trained: int | None = param(
        None,
        ge=1,
        help="stochastic (trained) steps drawn each iteration from step_range (UniRL num_sde_steps); "
        "null = every step of the range",
    )
    step_range: list[int] | None = param(
        None,
        help="[low, high]: the steps are drawn from low .. high - 1 (UniRL timestep_fraction [f0, f1] is "
        "[int(steps f0), int(steps f1)]); null = [0, steps]",
    )
    seed: int | None = param(
        None,
        help="null: the draw is seeded by the 0-based iteration alone, as UniRL's (the same in every run); "
        "an integer: by (seed, iteration)",
    )
    share_noise: bool = param(
        False, help="the G samples of a prompt start from the same noise (UniRL init_same_noise, default false)"
    )
    kl_steps: str = kl_steps_param()
    schedule: dict | None = schedule_param()
    final: str | None = final_param()
    kernel: Any = component("kernel", default="sde", help="the stochastic kernel of the drawn steps")
    _iteration: int = attrs.field(init=False, default=0)
    _drawn: list[int] = attrs.field(init=False, factory=list)

    nothing_to_train: ClassVar[str] = "the kernel has std 0 at every drawn step {drawn} of {sigmas}"

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._drawn = self.drawn_at(0)

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        errors = super().check_keys(keys, prefix) + step_range_errors(keys, prefix, "step_range")
        count, steps = keys.get("trained"), keys.get("steps")
        if errors or count is None or steps is None:
            return errors
        low, high = drawn_range(keys.get("step_range"), (0, steps))
        if count <= high - low:
            return errors
        return errors + [
            ConfigError(
                key(prefix, "trained"),
                f"got {count}; allowed: <= the {high - low} steps of step_range [{low}, {high}]",
            )
        ]

    @property
    def bounds(self) -> tuple[int, int]:
        """[low, high): the drawn steps' candidates."""
        return drawn_range(self.step_range, (0, self.steps))

    def drawn_at(self, iteration: int) -> list[int]:
        """The stochastic, trained steps of ``iteration`` (a pure function of the iteration number)."""
        return draw_steps(*self.bounds, self.trained, max(int(iteration), 0), self.seed)

    def advance(self, iteration: int) -> None:
        self._iteration = int(iteration)
        self._drawn = self.drawn_at(iteration)

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self._iteration, "drawn": list(self._drawn)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        drawn = [int(i) for i in state["drawn"]]
        low, high = self.bounds
        size = high - low if self.trained is None else min(self.trained, high - low)
        if drawn != sorted(set(drawn)) or len(drawn) != size or not all(low <= i < high for i in drawn):
            raise ValueError(
                f"saved drawn steps {drawn} are not {size} distinct ascending steps of [{low}, {high}) "
                f"(sampler.step_range, sampler.trained)"
            )
        self._iteration = int(state["iteration"])
        self._drawn = drawn

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        drawn = set(self._drawn)
        steps = [
            Step(self.kernel, sigmas, i, "sde") if i in drawn else Step(EULER, sigmas, i, "ode")
            for i in range(self.steps)
        ]
        return Plan(
            steps,
            prefix=min(drawn) if self.share_noise else 0,
            phases=("ode", "sde"),
            info={"drawn": list(self._drawn), "iteration": self._iteration},
        )
