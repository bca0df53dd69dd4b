"""DPM-Solver++(2M), the second-order multistep ODE solver, in the flow-matching parametrisation."""

from __future__ import annotations

from typing import ClassVar, NamedTuple, TypeGuard

import attrs
import torch

from fgrpo.samplers.kernels.base import KernelBase, StepInputs


class History(NamedTuple):
    x0: torch.Tensor  # data prediction of the previous step (detached, float32)
    sigma: torch.Tensor  # (batch, 1, ...) where it was predicted
    sigma_next: torch.Tensor  # (batch, 1, ...) where that step ended


@attrs.define
class DPMpp2MKernel(KernelBase):
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

    _history: History | None = attrs.field(default=None, init=False, repr=False, eq=False)

    def reset(self) -> None:
        """Forget the previous step: the next step is first order."""
        self._history = None

    def transition(self, s: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        x0 = s.sample - s.sigma * s.velocity
        out = first_order(s.sample, x0, s.sigma, s.sigma_next)
        hist = self._history
        if continues(hist, x0):
            second = (hist.sigma_next == s.sigma) & (s.sigma_next > 0) & (hist.sigma < 1) & (s.sigma < 1)
            if bool(second.any()):
                out = torch.where(second, out + second_order_term(x0, hist, s.sigma, s.sigma_next, second), out)
        self._history = History(x0.detach(), s.sigma, s.sigma_next)
        return out, None


# --- the pieces DPM-Solver++(3M) shares ------------------------------------------------------------


def first_order(x: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """x' = (sigma'/sigma) x + c0 x0 with c0 = alpha' - alpha sigma'/sigma = -alpha' (e^-h - 1)."""
    ratio = sigma_next / sigma
    return ratio * x + c0(sigma, sigma_next) * x0


def c0(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    return (1 - sigma_next) - (1 - sigma) * (sigma_next / sigma)


def continues(hist: History | None, x0: torch.Tensor) -> TypeGuard[History]:
    """Whether ``hist`` may continue into a step on ``x0`` (same batch shape and device)."""
    return hist is not None and hist.x0.shape == x0.shape and hist.x0.device == x0.device


def log_snr_step(s_from: torch.Tensor, s_to: torch.Tensor) -> torch.Tensor:
    """lambda(s_to) - lambda(s_from) as the log of a ratio, lambda = log((1 - s) / s)."""
    return torch.log((1 - s_to) * s_from / (s_to * (1 - s_from)))


def safe(where: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` where the higher-order term applies, else 1/2 (keeps unused logs finite)."""
    return torch.where(where, value, torch.full_like(value, 0.5))


def second_order_term(
    x0: torch.Tensor, hist: History, sigma: torch.Tensor, sigma_next: torch.Tensor, where: torch.Tensor
) -> torch.Tensor:
    """1/2 c0 D1 with D1 = (x0 - x0_prev) h / h_prev (diffusers' "midpoint" 2M update)."""
    h = log_snr_step(safe(where, sigma), safe(where, sigma_next))
    h_prev = torch.where(where, log_snr_step(safe(where, hist.sigma), safe(where, sigma)), torch.ones_like(sigma))
    d1 = (x0 - hist.x0) * (h / h_prev)
    return 0.5 * c0(sigma, sigma_next) * d1
