"""GRPO-Guard (``objective: {name: grpo-guard}``): RatioNorm and per-step gradient reweighting.

What is implemented, per sample i of the minibatch (c_i = the step's std = g·sqrt(-dt_i)):

    shift_i = mean_dims (mu_i - mu_old_i)^2 / (2 c_i^2)
    ratio_i = exp((logp_new_i - logp_old_i + shift_i) * c_i)                  # RatioNorm
    loss    = mean_i max(-A_i ratio_i, -A_i clip(ratio_i, 1-ε, 1+ε)) / (-dt_i)  # reweight
              + kl_beta * KL (same KL as ``grpo``, not reweighted)

Why: with a Gaussian step, logp_new - logp_old = mean(e·δ)/c² - mean(δ²)/(2c²) where
e = x' - mu_old ~ N(0, c²) and δ = mu - mu_old. The second term is never positive, so plain
ratios sit below 1 and the clip stops binding for positive advantages. Adding ``shift`` removes
it exactly; multiplying by c turns what is left into mean(e·δ)/c = mean(ξ·δ) with ξ ~ N(0, 1),
whose spread no longer depends on the step's noise level. Dividing by -dt evens out the
steps' gradient sizes.

Source: GRPO-Guard's "RatioNorm + Gradient Reweight" (the ratio exp[Δlogp·c + ‖δ‖²/(2c)] and the
loss divided by (sqrt Δt)²), which is the same expression as above, and the official flow_grpo
training script that implements it (``config.rationorm``), where c = std_dev_t·sqrt(-dt) with
std_dev_t the SDE noise g = η·sqrt(σ/(1-σ)). Written derivations of the method call σ_t "the forward
noise σ, not g"; the official code uses g, and so does docs/method.md; we follow the code. The
official code uses minibatch means of g and sqrt(-dt) (all its samples share a step); we use each
sample's own c and -dt, which is identical when they share a step and still right when a minibatch
mixes steps.

Needs the kernel's normalised Gaussian log-prob (``sde``, ``dance``, ``cps`` with
``normalized_logprob: true``) and std > 0: with CPS's default unnormalised log-prob -(x' - mu)^2
the shift no longer cancels the bias (measured: a normalised log-ratio bias of +3.6e-4, about 6
SD, at step 8 of 10), so a recipe that combines them is refused when it is validated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fgrpo.core.config import ConfigError
from fgrpo.core.objectives._ppo import (
    ClippedObjective,
    clip_range_param,
    clipped_surrogate,
    kernel_spec,
    kl_recipe_errors,
    per_sample,
    sq_dist,
)
from fgrpo.core.protocols import StepBatch


@attrs.frozen
class GRPOGuard(ClippedObjective):
    """GRPO with RatioNorm-centred ratios and a 1/(-dt) weight per step (see module docstring).

    The default clip 2e-6 is flow_grpo's GRPO-Guard setting for OCR/GenEval on SD3.5-M (its
    PickScore+HPS configs use 4e-6); normalised ratios are much closer to 1 than raw ones.
    """

    clip_range: float = clip_range_param(2e-6)

    @staticmethod
    def check_recipe(resolved: Mapping[str, Any]) -> list[ConfigError]:
        errors = kl_recipe_errors(resolved)
        kernel = kernel_spec(resolved)
        if kernel is not None and kernel.get("normalized_logprob") is False:
            errors.append(
                ConfigError(
                    "sampler.kernel.normalized_logprob",
                    f"got false with objective grpo-guard: RatioNorm needs the normalised Gaussian log-prob, and the "
                    f"kernel {kernel['name']!r} reports the unnormalised -(x' - mu)^2; set "
                    "sampler.kernel.normalized_logprob: true (or use objective grpo)",
                )
            )
        return errors

    def surrogate(
        self, batch: StepBatch, advantages: torch.Tensor, log_ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b = batch.log_prob.shape[0]
        c = per_sample(batch.std, b).detach()
        neg_dt = -per_sample(batch.dt, b).detach()
        # The shift carries gradient through mu, as in the official code.
        shift = sq_dist(batch.mean, batch.old_mean.detach()) / (2 * c**2)
        ratio = torch.exp((log_ratio + shift) * c)
        return ratio, (clipped_surrogate(ratio, advantages, self.clip_range) / neg_dt).mean()
