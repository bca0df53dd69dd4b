"""DPM-Solver++(2M), the second-order multistep ODE solver, in the flow-matching parametrisation."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import attrs
import torch

from fgrpo.core.protocols import KernelStep
from fgrpo.samplers.kernels._common import deterministic, prepare


class _History(NamedTuple):
    x0: torch.Tensor  # data prediction of the previous step (detached, float32)
    sigma: torch.Tensor  # (batch, 1, ...) where it was predicted
    sigma_next: torch.Tensor  # (batch, 1, ...) where that step ended


@attrs.define
class DPMpp2MKernel:
    """DPM-Solver++(2M) ODE step with alpha = 1 - sigma, lambda = log(alpha / sigma)::

        x0 = x - sigma v   (data prediction);   h = lambda' - lambda;   e^-h = alpha sigma' / (sigma alpha')
        first order:  x' = (sigma'/sigma) x + (alpha' - alpha sigma'/sigma) x0    (= the Euler step)
        second order: x' = first order + 1/2 (alpha' - alpha sigma'/sigma) D1,
                      D1 = (x0 - x0_prev) * h / h_prev,  h_prev = lambda - lambda_prev

    the "midpoint" solver of diffusers' ``DPMSolverMultistepScheduler`` (``algorithm_type=
    "dpmsolver++"``, ``solver_order=2``, ``final_sigmas_type="zero"``). Deterministic:
    ``std``/``log_prob`` are zeros and ``mean`` is x'.

    The kernel keeps the previous step's x0 (per sample). A step is second order when that
    history ends at this step's sigma (per sample) and neither sigma' = 0 (the final step is first
    order and returns x0) nor the previous sigma is 1 (lambda = -inf there: the second-order term
    vanishes, as in diffusers). Call ``reset()`` before each run of dpmpp2m steps; a step whose
    history does not match (other shape, other sigma) is first order anyway. Arithmetic and
    outputs are float32 whatever the input dtype.
    """

    stochastic: ClassVar[bool] = False

    _history: _History | None = attrs.field(default=None, init=False, repr=False, eq=False)

    def reset(self) -> None:
        """Forget the previous step: the next step is first order."""
        self._history = None

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
        x, sigma, sigma_next = s.sample, s.sigma, s.sigma_next
        alpha, alpha_next = 1 - sigma, 1 - sigma_next
        x0 = x - sigma * s.velocity
        ratio = sigma_next / sigma
        c0 = alpha_next - alpha * ratio  # = -alpha' (e^-h - 1)
        out = ratio * x + c0 * x0

        hist = self._history
        if hist is not None and hist.x0.shape == x0.shape and hist.x0.device == x0.device:
            second = (hist.sigma_next == sigma) & (sigma_next > 0) & (hist.sigma < 1) & (sigma < 1)
            if bool(second.any()):
                one = torch.ones_like(sigma)
                # lambda differences as logs of ratios, made safe where the step stays first order
                s_prev = torch.where(second, hist.sigma, 0.5 * one)
                s_next = torch.where(second, sigma_next, 0.5 * one)
                s_cur = torch.where(second, sigma, 0.5 * one)
                h = torch.log((1 - s_next) * s_cur / (s_next * (1 - s_cur)))
                h_prev = torch.log((1 - s_cur) * s_prev / (s_cur * (1 - s_prev)))
                h_prev = torch.where(second, h_prev, one)
                d1 = (x0 - hist.x0) * (h / h_prev)
                out = torch.where(second, out + 0.5 * c0 * d1, out)
        self._history = _History(x0.detach(), sigma, sigma_next)
        return deterministic(s, out)
