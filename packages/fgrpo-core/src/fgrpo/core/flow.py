"""The flow-matching schedule every package shares: SD3's time shift of the noise levels.

x_t = (1 - sigma) x0 + sigma eps; generation goes from sigma = 1 (noise) down to 0. The time
shift sigma' = s sigma / (1 + (s - 1) sigma) keeps 0 and 1 and, with s > 1, spends more steps at
high noise (diffusers' ``FlowMatchEulerDiscreteScheduler(shift=s)``). Computed in float64,
returned as float32, the dtype the kernels work in.
"""

from __future__ import annotations

import torch


def time_shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """``s * sigma / (1 + (s - 1) * sigma)`` of every value, float32."""
    s = sigmas.double()
    return (shift * s / (1 + (shift - 1) * s)).to(torch.float32)


def shifted_sigmas(steps: int, shift: float, device: torch.device | str | None = None) -> torch.Tensor:
    """(steps + 1,) float32 from 1 to 0: the linear grid, time-shifted by ``shift``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an integer >= 1, got {steps!r}")
    grid = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return time_shift(grid, shift).to(device)
