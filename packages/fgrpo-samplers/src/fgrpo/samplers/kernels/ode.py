"""The deterministic Euler step of the flow ODE."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fgrpo.core.protocols import KernelStep
from fgrpo.samplers.kernels._common import deterministic, prepare


@attrs.define
class ODEKernel:
    """Euler step of dx/dsigma = v: ``x' = x + dt * v`` with dt = sigma' - sigma < 0.

    Deterministic (``stochastic = False``): ``std`` and ``log_prob`` are zeros and ``mean`` is x'.
    ``noise`` and ``generator`` are ignored. Arithmetic and outputs are float32 whatever the
    input dtype.
    """

    stochastic: ClassVar[bool] = False

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
        return deterministic(s, s.sample + s.dt * s.velocity)
