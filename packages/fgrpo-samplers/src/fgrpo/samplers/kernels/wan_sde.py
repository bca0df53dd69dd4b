"""flow_grpo's Wan 2.1 SDE step: the Flow-GRPO drift with a diffusion linear in sigma."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.samplers.kernels.base import KernelBase, StepInputs


@attrs.define
class WanSDEKernel(KernelBase):
    """flow_grpo's Wan step (``wan_pipeline_with_logprob.sde_step_with_logprob``), sigma -> sigma'::

        g   = eta * (sigmas[-1] + (sigmas[1] - sigmas[-1]) * sigma)     (eta = 1: no noise level)
        mu  = x * (1 + g^2/(2 sigma) * dt) + v * (1 + g^2 (1 - sigma)/(2 sigma)) * dt
        std = g * sqrt(-dt);   x' = mu + std * eps

    The drift is the ``sde`` kernel's with this g; only the diffusion differs: linear in sigma and
    scaled by the schedule (``sigmas[1]``, the first step's target, and the last sigma, 0 on a
    schedule that ends at 0) instead of eta * sqrt(sigma / (1 - sigma)). On Wan 2.1's 20 steps
    (flow shift 3) the ``sde`` kernel with eta 0.7 has 39 times this std at step 0 and 1.4 to 5.4
    times it at steps 1-19 (docs/method.md). Any backbone can use it. ``log_prob`` is the exact Gaussian log-density
    averaged over non-batch dims; flow_grpo's Wan KL divides by the full std, so pair it with
    ``objective.kl_form: mean``.
    """

    stochastic: ClassVar[bool] = True
    #: the step's std is g * sqrt(-dt) (an Euler-Maruyama step)
    brownian: ClassVar[bool] = True
    #: flow_grpo's Wan pipeline decodes the last step's sample
    reference_final: ClassVar[str] = "sample"

    eta: float = param(
        1.0, ge=0, help="scale of g(sigma) = sigmas[-1] + (sigmas[1] - sigmas[-1]) * sigma; 1 = flow_grpo's Wan"
    )

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        sigma, dt = s.sigma, s.dt
        low, high = s.sigmas[-1], s.sigmas[1]
        g = self.eta * (low + (high - low) * sigma)
        half_g2_over_sigma = g * g / (2 * sigma)  # sigma > sigma' >= 0 on every step: no division by 0
        mean = s.sample * (1 + half_g2_over_sigma * dt) + s.velocity * (1 + half_g2_over_sigma * (1 - sigma)) * dt
        return mean, g * torch.sqrt(-dt)
