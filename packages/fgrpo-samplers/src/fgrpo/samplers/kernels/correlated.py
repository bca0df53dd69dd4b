"""Trajectory-shaped exploration: a Gaussian kernel whose noise is correlated along a plan's time
axis (and optionally grows along it), around any Gaussian kernel's mean.

Independent noise on every waypoint makes jagged candidate plans: most of a group's spread is
jerk, not a different manoeuvre. ``correlated`` keeps the base kernel's mean and its per-step
scale std (sde, dance, cps ...) and replaces the white noise by noise with the covariance
std^2 * C over the waypoints, the same for each coordinate (x, y[, heading]):

    C = S R S,   R[j, k] = (1 - white) exp(-(j - k)^2 / (2 length^2)) + white [j == k],
    S = diag(s_k),   s_k = ((k + 1) / T)^growth, normalised so that mean(s_k^2) = 1

``length`` is the correlation length in waypoints (0: independent), ``white`` the share of
independent noise that keeps C well conditioned, ``growth`` > 0 the scale-adaptive part (the
noise of far waypoints larger, as a plan's own uncertainty is; DiffusionDriveV2's multiplicative
noise has that shape). With C = L L^T (Cholesky): x' = mu + std L eps, and the exact log-density
of an action, averaged over the sample's dimensions as every kernel's log-prob is::

    log p = mean over (t, d) of [ -z^2 / 2 - log std - log L_tt - log(2 pi) / 2 ],   z = L^-1 (x' - mu) / std

(``KernelConformance`` and a test against torch's MultivariateNormal check it). ``axis`` is the
time axis of the sample (-2 for (B, T, D) plans); a sample without one (its batch axis would
be the time axis) gets the base kernel's independent noise. The KL to the reference is exact too: the
update hands the objectives means whitened by L^-1 (:meth:`CorrelatedKernel.whiten`), so their
||mu - mu_ref||^2 / (2 std^2) is the Mahalanobis distance of the two steps.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.protocols import KernelStep
from fgrpo.core.registry import component
from fgrpo.samplers.kernels.base import KernelBase, prepare

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@functools.lru_cache(maxsize=32)
def correlation_factor(steps: int, length: float, white: float, growth: float) -> torch.Tensor:
    """(steps, steps) float64 lower-triangular L with L L^T = C (see the module docstring)."""
    k = torch.arange(steps, dtype=torch.float64)
    if length > 0:
        r = (1 - white) * torch.exp(-((k[:, None] - k[None]) ** 2) / (2 * length**2)) + white * torch.eye(
            steps, dtype=torch.float64
        )
    else:
        r = torch.eye(steps, dtype=torch.float64)
    s = ((k + 1) / steps) ** growth
    s = s / s.pow(2).mean().sqrt()
    return torch.linalg.cholesky(s[:, None] * r * s[None])


@attrs.define
class CorrelatedKernel(KernelBase):
    """The base kernel's mean and std with noise correlated along the time axis (see the module
    docstring): ``kernel: {name: correlated, base: {name: sde, eta: 0.7}, length: 2.0}``."""

    stochastic: ClassVar[bool] = True
    base: Any = component("kernel", default="sde", help="the Gaussian kernel whose mean and std are used")
    length: float = param(
        2.0, ge=0.0, le=64.0, help="correlation length along the time axis, in steps (0: independent)"
    )
    white: float = param(
        0.05, gt=0.0, le=1.0, help="share of independent noise in the correlation (keeps it invertible)"
    )
    growth: float = param(
        0.0, ge=0.0, le=4.0, help="noise scale growing as ((k + 1) / T)^growth along the time axis (scale-adaptive)"
    )
    axis: int = param(-2, help="the time axis of a sample (-2: (B, T, D) plans)")

    @property
    def brownian(self) -> bool:
        return bool(getattr(self.base, "brownian", False))

    @property
    def reference_final(self) -> str:
        return str(getattr(self.base, "reference_final", "sample"))

    def factor(self, steps: int, device: torch.device) -> torch.Tensor:
        return correlation_factor(steps, float(self.length), float(self.white), float(self.growth)).to(
            device=device, dtype=torch.float32
        )

    def step(
        self,
        velocity: torch.Tensor,
        sample: torch.Tensor,
        sigmas: torch.Tensor,
        index: int | torch.Tensor,
        *,
        noise: torch.Tensor | None = None,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> KernelStep:
        s = prepare(velocity, sample, sigmas, index, noise=noise, prev_sample=prev_sample)
        axis = self.axis % s.sample.ndim
        if s.sample.ndim < 2 or axis == 0:  # no time axis (a probe, a flat sample): the base kernel as it is
            return self.base.step(
                s.velocity, s.sample, s.sigmas, s.index, noise=s.noise, prev_sample=s.prev_sample, generator=generator
            )
        base = self.base.step(s.velocity, s.sample, s.sigmas, s.index, noise=torch.zeros_like(s.sample))
        mean, std = base.mean, base.std
        lower = self.factor(s.sample.shape[axis], s.sample.device)
        positive = std > 0
        x_prev = s.prev_sample
        if x_prev is None:
            eps = (
                s.noise
                if s.noise is not None
                else torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
            )
            shaped = torch.movedim(torch.movedim(eps, axis, -1) @ lower.T, -1, axis)
            x_prev = torch.where(positive, mean + std * shaped, mean)
        return KernelStep(
            prev_sample=x_prev, mean=mean, std=std, log_prob=self.log_prob(x_prev, mean, std, lower, axis)
        )

    def whiten(self, t: torch.Tensor) -> torch.Tensor:
        """L^-1 applied along the time axis: with whitened means the objectives' ||mu - mu_ref||^2 /
        (2 std^2) is the exact KL between two such steps (the update whitens every mean it hands
        an objective, :func:`fgrpo.core.points.transitions.step_batch`)."""
        axis = self.axis % t.ndim
        if t.ndim < 2 or axis == 0:
            return t
        lower = self.factor(t.shape[axis], t.device)
        moved = torch.movedim(t.float(), axis, -1).unsqueeze(-1)
        return torch.movedim(torch.linalg.solve_triangular(lower, moved, upper=False).squeeze(-1), -1, axis)

    @staticmethod
    def log_prob(
        x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, lower: torch.Tensor, axis: int
    ) -> torch.Tensor:
        """The exact log-density of ``x`` under N(mean, std^2 C), averaged over non-batch dims; 0
        where std is 0 (a deterministic step)."""
        positive = std > 0
        safe = torch.where(positive, std, torch.ones_like(std))
        delta = torch.movedim((x.detach() - mean) / safe, axis, -1)  # (..., T)
        z = torch.linalg.solve_triangular(lower, delta.unsqueeze(-1), upper=False).squeeze(-1)
        log_diag = torch.log(torch.diagonal(lower))
        lp = -0.5 * z**2 - log_diag - _HALF_LOG_2PI
        lp = torch.movedim(lp, -1, axis) - torch.log(safe)
        lp = torch.where(positive, lp, torch.zeros_like(lp))
        return lp.reshape(lp.shape[0], -1).mean(dim=1)
