"""The deterministic Euler step of the flow ODE (kernel ``euler``; ``ode`` before, a name the
``ode`` sampler now has alone)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fgrpo.samplers.kernels.base import KernelBase, StepInputs


@attrs.define
class EulerKernel(KernelBase):
    """Euler step of dx/dsigma = v: ``x' = x + dt * v`` with dt = sigma' - sigma < 0.

    Deterministic (``stochastic = False``): ``std`` and ``log_prob`` are zeros and ``mean`` is x'.
    ``noise`` and ``generator`` are ignored. Arithmetic and outputs are float32 whatever the
    input dtype.
    """

    stochastic: ClassVar[bool] = False

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return s.sample + s.dt * s.velocity, None
