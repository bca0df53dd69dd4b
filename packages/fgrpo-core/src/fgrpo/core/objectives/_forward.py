"""What the forward-process objectives (nft, awm, dpo) share: per-point reductions,
the noise levels they train at, the velocity KL and the old policy's decay schedule.

A forward-process objective trains on finished samples re-noised at a drawn t (a
:class:`~fgrpo.core.protocols.ForwardBatch`); the trainer draws each item's t with the
objective's ``point_times`` and its noise from the same generator, seeded by (seed, iteration,
epoch, sample), so a resumed run and a run on N processes draw the same points.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fgrpo.core.config import param
from fgrpo.core.protocols import ForwardBatch


def dims_mean(x: torch.Tensor) -> torch.Tensor:
    """(b,) mean over every non-batch dimension."""
    return x.flatten(1).mean(1)


def per_row(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (b,) tensor shaped to broadcast over ``like`` (b, *shape)."""
    return t.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def fraction_count(steps: int, fraction: float) -> int:
    """int(steps * fraction), the references' count of trained timesteps (at least 1)."""
    return max(1, int(steps * fraction))


def timestep_fraction_param(default: float, reference: str) -> Any:
    return param(default, gt=0.0, le=1.0, help=f"points per item = int(rollout steps x fraction) ({reference})")


def velocity_kl(batch: ForwardBatch) -> torch.Tensor:
    """(b,) mean over dims of (v - v_ref)^2, gradient through the current velocity only."""
    if batch.ref_velocity is None:
        raise ValueError("a KL to the reference needs ForwardBatch.ref_velocity (see needs_reference)")
    return dims_mean((batch.velocity - batch.ref_velocity.detach()) ** 2)


def linear_decay(step: int, flat: int, rate: float, cap: float) -> float:
    """The old policy's decay after ``step`` optimizer steps: 0 for the first ``flat`` steps, then
    (step - flat) x rate, at most ``cap`` (DiffusionNFT's ``return_decay``, AWM's linear KL-EMA)."""
    return 0.0 if step < flat else min((step - flat) * rate, cap)


def discrete_indices(
    low: int, high: int, count: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """``count`` stratified step indices in [low, high]: boundaries linspace(low, high, count + 1)
    truncated to integers, one index drawn uniformly in each [lower, upper) (AWM's 'discrete')."""
    bounds = torch.linspace(low, high, count + 1, device=device)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(count, generator=generator, device=device)
    return lower + (u * (upper - lower)).long()


def logit_normal(
    count: int, mean: float, std: float, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """sigmoid(N(mean, std^2)) draws (diffusers' compute_density_for_timestep_sampling 'logit_normal')."""
    return torch.sigmoid(mean + std * torch.randn(count, generator=generator, device=device))


def shift(t: torch.Tensor, s: float) -> torch.Tensor:
    """SD3's time shift s t / (1 + (s - 1) t)."""
    return s * t / (1 + (s - 1) * t)


def normal_icdf(u: torch.Tensor) -> torch.Tensor:
    return math.sqrt(2.0) * torch.erfinv(2 * u - 1)
