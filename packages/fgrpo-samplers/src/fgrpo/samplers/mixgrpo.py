"""``mixgrpo`` (MixGRPO): a sliding window of stochastic steps, ODE elsewhere, optional Flash.

The window is ``window`` consecutive steps ``[start, start + window)`` that use the stochastic
kernel and are trained; every other step is an Euler ODE step. ``step_index`` is (B, window), the
same row for every sample.

Where the window may be: inside ``[0, window_end)``, ``window_end`` defaulting to ``steps - 2``
(the MixGRPO code passes ``sampling_steps - 2`` as its bound and never trains the last two
steps). By default the window always has its full size, so the last allowed start is
``window_end - window``. With ``shrink: true`` it behaves as the reference's: starts go on up to
``window_end - 1`` and the window is ``[start, min(start + window, window_end))``, shrinking near
the bound (the reference also visits ``start = window_end``, an empty window that trains nothing;
fgrpo skips that position).

How it moves: ``advance(iteration)`` (called by the trainer at the start of every iteration)
places the window for that iteration, as a pure function of the iteration number. The window
visits the positions 0, stride, 2 stride, ... up to the last allowed start and stays
``dwell(start)`` iterations at each (MixGRPO's ``iters_per_group``):

- ``progressive``: dwell = ``shift_every``. Past the last allowed start, ``at_end: rollback``
  goes back to 0 (MixGRPO ``roll_back``) and ``at_end: stay`` stays at the last allowed start.
- ``decay`` (MixGRPO): the dwell falls linearly with the position, from ``shift_every`` at start
  0 to ``min_shift_every`` at ``window_end``: max(min, int(shift_every (1 - p) + min p)),
  p = start / window_end (the reference's ``max_iters_per_group``/``min_iters_per_group``).
- ``exp_decay`` (MixGRPO): dwell = ceil(shift_every exp(-decay_rate max(0, start -
  decay_threshold))) (the reference's ``exp_decay_k`` 0.1 and ``exp_decay_thre_timestep`` 13).
- ``random``: start is drawn uniformly from [0, window_end - window] every ``shift_every``
  iterations, from a generator seeded with (``seed``, shift): reproducible, and the same after a
  resume (``shift_every: 1`` redraws every iteration, as the MixGRPO code does). The drawn window
  always has its full size, as in the reference.

A frozen window (MixGRPO-Flash*, window fixed at [0, 4)) is ``shift_every`` larger than the run.

``flash: true`` (MixGRPO-Flash) replaces the Euler steps after the window by DPM-Solver++
(``flash_order`` 2: kernel ``dpmpp2m``, MixGRPO-Flash's setting; 3: ``dpmpp3m``) on a compressed
schedule: ``int((steps - last) * flash_ratio)`` points from the sigma reached after the window down
to 0, ``last`` being the window's last step (the MixGRPO rule), at least 2 points (one step) and
never more steps than the Euler steps it replaces. The
points are the main schedule's tail resampled by linear interpolation in step index, so the
compressed schedule keeps the shape (shift, flux, explicit) of the main one. The multistep
history starts fresh after the window (its first step is first order; the reference feeds the
window's x0 predictions into the solver's history, so its first step after the window is already
second order). A higher-order solver is never used before the window.

Initial noise is shared within a group (``share_noise``, as MixGRPO does); then the ODE prefix
before the window is computed once per prompt (``share_prefix``), see ``fast``.

``final`` chooses the decoded image (see :func:`fgrpo.samplers.base.final_param`); it only matters when the
window reaches the last step (the step after a window is deterministic, and its Euler step to
sigma' = 0 already returns x0: MixGRPO's ``drop_last_sample`` changes nothing there).

State (``state_dict``): ``{"iteration": int, "window_start": int}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core.config import ConfigError, param
from fgrpo.core.registry import component
from fgrpo.core.seeding import generator as seeded_generator
from fgrpo.samplers.base import EULER, GroupSampler, Plan, Step, final_param, key, kl_steps_param, schedule_param
from fgrpo.samplers.kernels.dpmpp2m import DPMpp2MKernel
from fgrpo.samplers.kernels.dpmpp3m import DPMpp3MKernel

STRATEGIES = ("progressive", "decay", "exp_decay", "random")


def flash_sigmas(sigmas: torch.Tensor, last: int, ratio: float) -> torch.Tensor | None:
    """The compressed schedule after the window whose last step is ``last`` (None: nothing left)."""
    steps = sigmas.shape[0] - 1
    remaining = steps - (last + 1)
    if remaining <= 0:
        return None
    points = min(max(int((steps - last) * ratio), 2), remaining + 1)
    tail = sigmas[last + 1 :].to(torch.float64)
    where = torch.linspace(0, remaining, points, dtype=torch.float64, device=sigmas.device)
    below = where.floor().long().clamp(max=remaining - 1)
    frac = where - below
    out = tail[below] * (1 - frac) + tail[below + 1] * frac
    out[0], out[-1] = tail[0], tail[-1]
    return out.to(torch.float32)


@attrs.define
class MixGRPOSampler(GroupSampler):
    """MixGRPO: a sliding window of stochastic, trained steps that moves with the iterations, Euler
    steps before it and Euler or DPM-Solver++ (Flash) steps after it (see the module docstring)."""

    steps: int = param(10, ge=1, help="sampling steps")
    window: int = param(4, ge=1, help="consecutive stochastic (trained) steps")
    stride: int = param(1, ge=1, help="steps the window moves at each shift")
    shift_every: int = param(25, ge=1, help="iterations between two shifts of the window")
    strategy: str = param("progressive", choices=STRATEGIES, help="how the window moves (MixGRPO sample_strategy)")
    min_shift_every: int | None = param(
        None,
        ge=1,
        help="decay: the dwell at window_end; null = max(1, shift_every // 4) (MixGRPO min_iters_per_group)",
    )
    decay_threshold: int = param(13, ge=0, help="exp_decay: the start after which the dwell decays")
    decay_rate: float = param(
        0.1, ge=0, help="exp_decay: dwell = ceil(shift_every * exp(-rate * (start - threshold)))"
    )
    shrink: bool = param(
        False, help="the window shrinks near window_end instead of stopping at full size (as MixGRPO)"
    )
    window_end: int | None = param(
        None, ge=1, help="the window stays inside [0, window_end); null = steps - 2 (MixGRPO)"
    )
    at_end: str = param("rollback", choices=("rollback", "stay"), help="progressive, past the end: back to 0, or stay")
    flash: bool = param(False, help="DPM-Solver++ on a compressed schedule after the window")
    flash_order: int = param(2, choices=(2, 3), help="order of the Flash DPM-Solver++ (MixGRPO dpm_solver_order)")
    flash_ratio: float = param(0.4, gt=0.0, le=1.0, help="compression of the steps after the window")
    share_noise: bool = param(True, help="the G samples of a prompt start from the same initial noise")
    share_prefix: bool = param(True, help="compute the ODE prefix once per prompt (needs share_noise)")
    seed: int = param(0, help="seeds the random strategy's window draws")
    kl_steps: str = kl_steps_param()
    schedule: dict | None = schedule_param()
    final: str | None = final_param()
    kernel: Any = component("kernel", default="sde", help="the stochastic kernel of the window")
    _iteration: int = attrs.field(init=False, default=0)
    _start: int = attrs.field(init=False, default=0)
    #: the Flash solver: stateful (its multistep history), so one per sampler
    _dpm: Any = attrs.field(init=False, default=None, repr=False, eq=False)

    nothing_to_train: ClassVar[str] = "the kernel has std 0 on the whole window {window} of {sigmas}"

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._start = self.window_start_at(0)
        self._dpm = DPMpp2MKernel() if self.flash_order == 2 else DPMpp3MKernel()

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        errors = super().check_keys(keys, prefix)
        if not all(k in keys for k in ("steps", "window", "window_end")):
            return errors
        steps, window, given = keys["steps"], keys["window"], keys["window_end"]
        end = steps - 2 if given is None else given
        if window <= end <= steps:
            return errors
        return errors + [
            ConfigError(
                key(prefix, "window_end" if given is not None else "window"),
                f"the window of {window} steps must fit in [0, window_end = {end}) with "
                f"window_end <= steps ({steps}); window_end defaults to steps - 2",
            )
        ]

    # --- the window schedule -------------------------------------------------------------------

    @property
    def end(self) -> int:
        return self.steps - 2 if self.window_end is None else int(self.window_end)

    @property
    def last_start(self) -> int:
        """The last start the window visits (a shrinking window goes on to window_end - 1)."""
        if self.shrink and self.strategy != "random":
            return self.end - 1
        return self.end - self.window

    @property
    def window_start(self) -> int:
        return self._start

    def window_at(self, start: int) -> list[int]:
        """The steps of the window that starts at ``start``."""
        return list(range(start, min(start + self.window, self.end) if self.shrink else start + self.window))

    def dwell(self, start: int) -> int:
        """Iterations the window stays at ``start`` (MixGRPO's iters_per_group at that position)."""
        if self.strategy == "decay":
            low = self.min_shift_every if self.min_shift_every is not None else max(1, self.shift_every // 4)
            progress = start / self.end
            return max(low, int(self.shift_every * (1 - progress) + low * progress))
        if self.strategy == "exp_decay":
            decayed = self.shift_every * math.exp(-self.decay_rate * max(0, start - self.decay_threshold))
            return max(1, math.ceil(decayed))
        return self.shift_every

    def window_start_at(self, iteration: int) -> int:
        """Where the window starts at ``iteration`` (a pure function of the iteration number)."""
        iteration = max(int(iteration), 0)
        last = self.last_start
        if self.strategy == "random":
            shift = iteration // self.shift_every
            rng = seeded_generator(self.seed, "mixgrpo-window", shift)
            return int(torch.randint(0, last + 1, (1,), generator=rng).item())
        positions = list(range(0, last + 1, self.stride))
        if self.at_end == "stay" and positions[-1] != last:
            positions.append(last)  # clamped to the last allowed start, where it stays
        dwells = [self.dwell(p) for p in positions]
        cycle = sum(dwells)
        if iteration >= cycle:
            if self.at_end == "stay":
                return positions[-1]
            iteration %= cycle
        for position, dwell in zip(positions, dwells, strict=True):
            if iteration < dwell:
                return position
            iteration -= dwell
        raise AssertionError("unreachable: the iteration lies inside one cycle")

    def advance(self, iteration: int) -> None:
        self._iteration = int(iteration)
        self._start = self.window_start_at(iteration)

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self._iteration, "window_start": self._start}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        start = int(state["window_start"])
        if not 0 <= start <= self.last_start:
            raise ValueError(
                f"saved window start {start} is outside [0, {self.last_start}] for "
                f"steps {self.steps}, window {self.window}, window_end {self.end}"
            )
        self._iteration = int(state["iteration"])
        self._start = start

    # --- the rollout ---------------------------------------------------------------------------

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        start = self._start
        window = self.window_at(start)
        last = window[-1]
        steps = [Step(EULER, sigmas, i, "prefix") for i in range(start)]
        steps += [Step(self.kernel, sigmas, i, "window") for i in window]
        info: dict[str, Any] = {"window_start": start, "window": window, "iteration": self._iteration}
        compressed = flash_sigmas(sigmas, last, self.flash_ratio) if self.flash else None
        if compressed is not None:
            steps += [Step(self._dpm, compressed, j, "flash") for j in range(len(compressed) - 1)]
            info["flash_sigmas"] = compressed.tolist()
        else:
            steps += [Step(EULER, sigmas, i, "suffix") for i in range(last + 1, self.steps)]
        return Plan(
            steps,
            prefix=start if (self.share_noise and self.share_prefix) else 0,
            phases=("prefix", "window", "flash" if self.flash else "suffix"),
            info=info,
        )
