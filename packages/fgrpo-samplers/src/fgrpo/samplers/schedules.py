"""Sigma schedules: T + 1 decreasing noise levels from (about) 1 down to 0, float32.

``linear`` is the uniform grid; ``time_shift`` is SD3's shift sigma' = s sigma / (1 + (s - 1) sigma);
``flux_shift`` is FLUX's resolution-dependent shift; ``explicit`` takes the values as given.
:class:`Schedule` is the recipe-facing form (``{type: shift, shift: 3.0}``). Values are computed
in float64 and returned as float32, the dtype the kernels work in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import attrs
import torch

from fgrpo.core import flow
from fgrpo.core.config import param


def check_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """Return ``sigmas`` unchanged if it is a valid schedule, else raise ``ValueError``.

    Valid: a 1-D floating-point tensor of at least 2 finite values in [0, 1], strictly
    decreasing. The error names the offending index and value.
    """
    if not isinstance(sigmas, torch.Tensor):
        raise ValueError(f"sigmas: expected a 1-D float tensor, got {type(sigmas).__name__}")
    if not sigmas.is_floating_point():
        raise ValueError(f"sigmas: expected a floating-point tensor, got dtype {sigmas.dtype}")
    if sigmas.ndim != 1:
        raise ValueError(f"sigmas: expected a 1-D tensor, got shape {tuple(sigmas.shape)}")
    if sigmas.shape[0] < 2:
        raise ValueError(f"sigmas: expected at least 2 values (one step), got {sigmas.shape[0]}")
    values = sigmas.detach().cpu().double().tolist()
    for i, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"sigmas: expected finite values, got sigmas[{i}] = {value}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"sigmas: expected values in [0, 1], got sigmas[{i}] = {value}")
        if i and value >= values[i - 1]:
            raise ValueError(
                "sigmas: expected strictly decreasing values, got "
                f"sigmas[{i}] = {value} >= sigmas[{i - 1}] = {values[i - 1]}"
            )
    return sigmas


def _check_steps(steps: object) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an integer >= 1, got {steps!r}")
    return steps


def linear(steps: int) -> torch.Tensor:
    """``steps + 1`` equally spaced values from 1 to 0 (float32)."""
    steps = _check_steps(steps)
    return torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).to(torch.float32)


def time_shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's shift ``s * sigma / (1 + (s - 1) * sigma)``: keeps 0 and 1, s > 1 spends more steps
    at high noise. Same values as diffusers' ``FlowMatchEulerDiscreteScheduler(shift=s)``."""
    if not shift > 0 or not math.isfinite(shift):
        raise ValueError(f"shift: expected a finite number > 0, got {shift!r}")
    return flow.time_shift(sigmas, shift)


def flux_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's shift exponent: linear in the number of image tokens, base_shift at base_seq_len and
    max_shift at max_seq_len."""
    if max_seq_len == base_seq_len:
        raise ValueError("max_seq_len: expected a value different from base_seq_len")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def flux_shift(
    sigmas: torch.Tensor,
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> torch.Tensor:
    """FLUX's resolution-dependent shift ``e^mu / (e^mu + 1/sigma - 1)`` with
    mu = :func:`flux_mu` (``image_seq_len`` = number of latent tokens); sigma = 0 stays 0.
    Equivalent to :func:`time_shift` with s = e^mu."""
    if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, int) or image_seq_len < 1:
        raise ValueError(f"image_seq_len: expected an integer >= 1, got {image_seq_len!r}")
    e_mu = math.exp(flux_mu(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift))
    s = sigmas.double()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    shifted = e_mu / (e_mu + 1 / safe - 1)
    return torch.where(s > 0, shifted, torch.zeros_like(s)).to(torch.float32)


def explicit(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """The given values as a float32 schedule, checked with :func:`check_sigmas`."""
    if isinstance(values, torch.Tensor):
        if not values.is_floating_point():
            values = values.double()
        t = values.detach().to(torch.float32)
    else:
        try:
            t = torch.tensor([float(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"values: expected a list of numbers, got {values!r}") from exc
    return check_sigmas(t)


ScheduleType = Literal["linear", "shift", "flux", "explicit"]


@attrs.define
class Schedule:
    """The sigma schedule of a recipe; ``Schedule(...)(steps)`` returns steps + 1 float32 values.

    - ``linear``: 1 -> 0 in equal steps.
    - ``shift``: SD3 time shift of the linear grid by ``shift``.
    - ``flux``: FLUX's resolution-dependent shift for ``image_seq_len`` latent tokens.
    - ``explicit``: ``values`` as given (``len(values)`` must be steps + 1).
    """

    type: ScheduleType = param(
        "shift", choices=("linear", "shift", "flux", "explicit"), help="how the sigmas are spaced"
    )
    shift: float = param(3.0, gt=0, help="SD3 time shift s of sigma' = s*sigma/(1+(s-1)*sigma) (type: shift)")
    values: list[float] | None = param(None, help="the sigmas themselves, 1 -> 0 (type: explicit)")
    image_seq_len: int | None = param(None, ge=1, help="number of latent image tokens (type: flux)")

    def __attrs_post_init__(self) -> None:
        if self.type == "explicit" and self.values is None:
            raise ValueError("values: required when type is 'explicit' (a list of sigmas from 1 to 0)")
        if self.type == "flux" and self.image_seq_len is None:
            raise ValueError("image_seq_len: required when type is 'flux' (the number of latent tokens)")

    def __call__(self, steps: int) -> torch.Tensor:
        steps = _check_steps(steps)
        if self.type == "linear":
            sigmas = linear(steps)
        elif self.type == "shift":
            sigmas = time_shift(linear(steps), self.shift)
        elif self.type == "flux":
            assert self.image_seq_len is not None  # checked when built
            sigmas = flux_shift(linear(steps), int(self.image_seq_len))
        else:
            assert self.values is not None  # checked when built
            sigmas = explicit(self.values)
            if sigmas.shape[0] != steps + 1:
                raise ValueError(f"values: expected steps + 1 = {steps + 1} sigmas, got {sigmas.shape[0]}")
        return check_sigmas(sigmas)
