"""Coefficients-preserving sampling (CPS): re-noise the predicted clean sample to sigma'."""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.samplers.kernels.base import KernelBase, StepInputs


@attrs.define
class CPSKernel(KernelBase):
    """CPS step, sigma -> sigma'::

        std    = sigma' * sin(eta * pi / 2)
        x0_hat = x - sigma v;   x1_hat = x + (1 - sigma) v
        mu     = (1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) x1_hat;   x' = mu + std * eps

    so that x' keeps the coefficients (1 - sigma') of data and sigma' of (unit) noise. The last
    step to sigma' = 0 has std 0: it is deterministic (x' = x0_hat, log-prob 0) and must not be
    trained (samplers check ``KernelStep.std == 0``).

    ``log_prob``: by default the reference implementations' unnormalised -(x' - mu)^2, averaged
    over non-batch dims; ``normalized_logprob=True`` gives the exact Gaussian log-density.
    Arithmetic and outputs are float32 whatever the input dtype.
    """

    stochastic: ClassVar[bool] = True
    #: the step's std is not g * sqrt(-dt): flow_grpo's KL form is the exact KL here
    brownian: ClassVar[bool] = False
    #: what a sampler decodes by default (``final: null``): its last step to sigma' = 0 is deterministic: the sample is
    #: x0
    reference_final: ClassVar[str] = "sample"

    eta: float = param(0.8, ge=0, le=1, help="noise level: std = sigma' * sin(eta * pi / 2)")
    normalized_logprob: bool = param(
        False, help="exact Gaussian log-density instead of the reference's unnormalised -(x'-mu)^2"
    )

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, v, sigma, sigma_next = s.sample, s.velocity, s.sigma, s.sigma_next
        std = sigma_next * math.sin(float(self.eta) * math.pi / 2)
        x0_hat = x - sigma * v
        x1_hat = x + (1 - sigma) * v
        # clamp: sigma'^2 - std^2 = (sigma' cos)^2 >= 0, but rounding may make it -1e-9 at eta = 1
        mean = x0_hat * (1 - sigma_next) + x1_hat * torch.sqrt((sigma_next**2 - std**2).clamp_min(0))
        return mean, std
