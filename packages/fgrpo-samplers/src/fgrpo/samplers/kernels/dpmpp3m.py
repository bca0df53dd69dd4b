"""DPM-Solver++(3M), the third-order multistep ODE solver, in the flow-matching parametrisation."""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fgrpo.samplers.kernels.base import KernelBase, StepInputs
from fgrpo.samplers.kernels.dpmpp2m import (
    History,
    continues,
    first_order,
    log_snr_step,
    safe,
    second_order_term,
)


@attrs.define
class DPMpp3MKernel(KernelBase):
    """DPM-Solver++(3M) ODE step (alpha = 1 - sigma, lambda = log(alpha / sigma), x0 = x - sigma v)::

        h = lambda' - lambda,  h0 = lambda - lambda_1,  h1 = lambda_1 - lambda_2,  r0 = h0/h,  r1 = h1/h
        D1_0 = (x0 - x0_1) / r0,   D1_1 = (x0_1 - x0_2) / r1
        D1 = D1_0 + r0/(r0 + r1) (D1_0 - D1_1),   D2 = (D1_0 - D1_1)/(r0 + r1)
        x' = (sigma'/sigma) x - alpha'(e^-h - 1) x0 + alpha'((e^-h - 1)/h + 1) D1
             - alpha'((e^-h - 1 + h)/h^2 - 1/2) D2

    (x0_1, x0_2: the data predictions of the two previous steps), diffusers'
    ``DPMSolverMultistepScheduler`` with ``algorithm_type="dpmsolver++"``, ``solver_order=3``,
    ``final_sigmas_type="zero"``, ``lower_order_final=True``, and MixGRPO-Flash's
    ``dpm_solver_order: 3``. The order drops where diffusers drops it: the first step of a run is
    first order, the second is second order (:class:`DPMpp2MKernel`'s update); the final step
    (sigma' = 0) is first order and returns x0; on a schedule of fewer than 15 steps the step
    before the final one is second order; a history that reaches back to sigma = 1 (lambda =
    -inf) reduces the update to the lower order exactly as diffusers' formulas do.

    History is per sample, as in ``dpmpp2m``: call ``reset()`` before each run. Deterministic:
    ``std``/``log_prob`` are zeros and ``mean`` is x'. Arithmetic and outputs are float32.
    """

    stochastic: ClassVar[bool] = False

    _history: tuple[History, ...] = attrs.field(factory=tuple, init=False, repr=False, eq=False)

    def reset(self) -> None:
        """Forget the previous steps: the next step is first order."""
        self._history = ()

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, sigma, sigma_next = s.sample, s.sigma, s.sigma_next
        x0 = x - sigma * s.velocity
        out = first_order(x, x0, sigma, sigma_next)
        history = tuple(h for h in self._history if continues(h, x0))
        if len(history) == len(self._history) and history:
            last = history[-1]
            view = (x0.shape[0],) + (1,) * (x0.ndim - 1)
            # diffusers' lower_order_second: the step before the final one of a short schedule
            steps = s.sigmas.shape[0] - 1
            short = (s.index == steps - 2).reshape(view) & (steps < 15)
            second = (last.sigma_next == sigma) & (sigma_next > 0) & (last.sigma < 1) & (sigma < 1)
            third = second & ~short
            if len(history) == 2:
                third = third & (history[0].sigma_next == last.sigma)
            else:
                third = torch.zeros_like(second)
            two = second & ~third
            if bool(two.any()):
                out = torch.where(two, out + second_order_term(x0, last, sigma, sigma_next, two), out)
            if bool(third.any()):
                out = torch.where(
                    third, out + _third_order_terms(x0, (history[0], history[1]), sigma, sigma_next, third), out
                )
        else:
            history = ()
        self._history = (*history[-1:], History(x0.detach(), sigma, sigma_next))
        return out, None


def _third_order_terms(
    x0: torch.Tensor,
    history: tuple[History, History],
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    where: torch.Tensor,
) -> torch.Tensor:
    """alpha'((e^-h - 1)/h + 1) D1 - alpha'((e^-h - 1 + h)/h^2 - 1/2) D2 (added to the first-order step).

    Where the oldest sigma is 1, h1 = inf: D1_1/r1 and D2 vanish and D1 = D1_0, as in diffusers.
    """
    older, last = history
    h = log_snr_step(safe(where, sigma), safe(where, sigma_next))
    h0 = log_snr_step(safe(where, last.sigma), safe(where, sigma))
    finite = where & (older.sigma < 1)
    h1 = log_snr_step(safe(finite, older.sigma), safe(finite, last.sigma))
    r0, r1 = h0 / h, h1 / h
    d1_0 = (x0 - last.x0) / r0
    d1_1 = (last.x0 - older.x0) / r1
    d1 = torch.where(finite, d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1), d1_0)
    d2 = torch.where(finite, (d1_0 - d1_1) / (r0 + r1), torch.zeros_like(d1_0))
    alpha_next = 1 - sigma_next
    em1 = torch.exp(-h) - 1.0
    return alpha_next * (em1 / h + 1.0) * d1 - alpha_next * ((em1 + h) / h**2 - 0.5) * d2
