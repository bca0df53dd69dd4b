"""DanceGRPO's SDE step: constant diffusion g = eta with the score correction."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.samplers.kernels.base import KernelBase, StepInputs


@attrs.define
class DanceKernel(KernelBase):
    """DanceGRPO step, sigma -> sigma' (dt = sigma' - sigma < 0), constant g = eta::

        x0_hat = x - sigma v;   score = -(x - (1 - sigma) x0_hat) / sigma^2
        mu     = x + dt v - eta^2/2 * score * dt;   std = eta * sqrt(-dt)

    The score term is evaluated in the equivalent form eta^2/2 * (x + (1 - sigma) v) * (dt/sigma),
    where dt/sigma lies in [-1, 0), so nothing overflows as sigma -> 0. ``log_prob`` is the exact
    Gaussian log-density averaged over non-batch dims. Arithmetic and outputs are float32
    whatever the input dtype.
    """

    stochastic: ClassVar[bool] = True
    #: the step's std is g * sqrt(-dt) (an Euler-Maruyama step): flow_grpo's KL divides by 2 g^2
    brownian: ClassVar[bool] = True
    #: what a sampler decodes by default (``final: null``): DanceGRPO decodes the last step's predicted x0
    reference_final: ClassVar[str] = "x0"

    eta: float = param(0.3, ge=0, help="constant diffusion coefficient g = eta")

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, v, sigma, dt = s.sample, s.velocity, s.sigma, s.dt
        eta2 = float(self.eta) ** 2
        # -score * sigma = x + (1 - sigma) v, since x - (1 - sigma)(x - sigma v) = sigma (x + (1 - sigma) v)
        mean = x + dt * v + (0.5 * eta2) * (x + (1 - sigma) * v) * (dt / sigma)
        std = self.eta * torch.sqrt(-dt)
        return mean, std
