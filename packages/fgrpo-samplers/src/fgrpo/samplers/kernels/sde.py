"""Flow-GRPO's SDE step: the flow ODE plus a score correction and sigma-adaptive noise."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.samplers.kernels.base import KernelBase, StepInputs


@attrs.define
class SDEKernel(KernelBase):
    """Flow-GRPO step, sigma -> sigma' (dt = sigma' - sigma < 0)::

        g   = eta * sqrt(sigma / (1 - sigma))        (sigma == 1: 1 - sigmas[1] in the denominator)
        mu  = x * (1 + g^2/(2 sigma) * dt) + v * (1 + g^2 (1 - sigma)/(2 sigma)) * dt
        std = g * sqrt(-dt);   x' = mu + std * eps

    The coefficients are evaluated as g^2/(2 sigma) = eta^2 / (2 (1 - sigma_d)) (sigma_d the
    denominator's sigma), the same numbers without dividing by sigma, so nothing overflows as
    sigma -> 0. ``log_prob`` is the exact Gaussian log-density averaged over non-batch dims.
    Arithmetic and outputs are float32 whatever the input dtype.
    """

    stochastic: ClassVar[bool] = True
    #: the step's std is g * sqrt(-dt) (an Euler-Maruyama step): flow_grpo's KL divides by 2 g^2
    brownian: ClassVar[bool] = True
    #: what a sampler decodes by default (``final: null``): flow_grpo decodes the last step's sample
    reference_final: ClassVar[str] = "sample"

    eta: float = param(0.7, ge=0, help="noise level eta of g(sigma) = eta*sqrt(sigma/(1-sigma))")

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        sigma, dt = s.sigma, s.dt
        # As the reference: at sigma == 1 the denominator uses sigmas[1] (1 - 1 would be 0).
        one_minus = 1 - torch.where(sigma == 1, s.sigmas[1], sigma)
        eta2 = float(self.eta) ** 2
        g = self.eta * torch.sqrt(sigma / one_minus)
        x_coef = 1 + eta2 / (2 * one_minus) * dt  # 1 + g^2/(2 sigma) dt
        v_coef = (1 + eta2 * (1 - sigma) / (2 * one_minus)) * dt  # (1 + g^2 (1-sigma)/(2 sigma)) dt
        mean = s.sample * x_coef + s.velocity * v_coef
        std = g * torch.sqrt(-dt)
        return mean, std
