"""Flow-DPPO (``objective: {name: flow-dppo}``): an exact-KL trust region instead of the ratio clip.

What is implemented, per sample i of the minibatch (s_i the step's std, D the non-batch dims):

    ratio_i = exp(logp_new_i - logp_old_i)
    kl_i    = mean_dims (mu_i - mu_old_i)^2 / (2 s_i^2)    # exact KL(old || new) of the step, / D
    drop_i  = kl_i >= τ and ((ratio_i > 1 and A_i > 0) or (ratio_i < 1 and A_i < 0))
    loss    = mean_i [not drop_i] * (-A_i ratio_i) + kl_beta * KL_ref    (KL_ref as ``grpo``'s)

Both step policies are Gaussians with the same std, so their KL is exact and needs no sample.
A step is dropped (no gradient) only when it is already outside the trust region (kl >= τ,
``kl_mask_threshold``) *and* its gradient would push it further out (raise an action with A > 0
that is already more likely, or lower one with A < 0 that is already less likely); inside the
region, or moving back toward the old policy, the unclipped -A·ratio trains as is. The mask is a
constant of the step (no gradient through kl).

Source: Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py`` (``_flowdppo_kl_adv_loss``; see
docs/method.md for the commit and lines): the same mask, the same mean over the latent dims, the
same strict comparisons, the threshold 1e-5 and ``add_kl_coefficient`` (false: the std is taken as
1). Where fgrpo differs: the std is the kernel's own (the reference recomputes the ``sde`` one from
the sigmas, with σ clamped at 0.99; it differs only at σ > 0.99, and for ``cps`` fgrpo's is the
exact KL), μ_old is the mean stored at sampling time (the reference replays it at the pre-update
weights: the same numbers when sampling is on-policy, as ``fgrpo check`` proves), and the
house's ``adv_clip`` (5, binding only beyond |A| = 5) and optional KL to the reference
(``kl_beta``, off by default; Flow-Factory's Flow-DPPO has both) are kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fgrpo.core.config import ConfigError, param
from fgrpo.core.objectives._ppo import (
    KlForm,
    adv_clip_param,
    as_float,
    clip_advantages,
    kl_beta_param,
    kl_form_param,
    kl_recipe_errors,
    kl_term,
    per_sample,
    sq_dist,
)
from fgrpo.core.objectives.base import TransitionObjective
from fgrpo.core.protocols import ObjectiveOutput, StepBatch


@attrs.frozen
class FlowDPPO(TransitionObjective):
    """Flow-DPPO: the unclipped -A·ratio, with the gradient of a step dropped where the exact KL
    between its old and new Gaussian exceeds ``kl_mask_threshold`` and the step moves further
    away (see the module docstring). Metrics: ``clipfrac`` is the fraction dropped
    (``clipfrac_above`` with ratio > 1 and A > 0, ``clipfrac_below`` with ratio < 1 and A < 0),
    ``kl_mask_fraction`` the fraction outside the region, ``kl_new_old_mean`` / ``_max`` the KL."""

    kl_mask_threshold: float = param(
        1e-5,
        gt=0,
        help="trust region τ: a step whose KL(old || new) averaged over dims is >= τ and moves further "
        "away gets no gradient",
    )
    add_kl_coefficient: bool = param(
        True, help="divide the mean shift by the step's std (the exact KL); false: the raw (mu - mu_old)^2 / 2"
    )
    adv_clip: float = adv_clip_param()
    kl_beta: float = kl_beta_param()
    kl_form: KlForm = kl_form_param()

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    @staticmethod
    def check_recipe(resolved: Mapping[str, Any]) -> list[ConfigError]:
        return kl_recipe_errors(resolved)

    def __call__(self, batch: StepBatch) -> ObjectiveOutput:
        advantages = clip_advantages(batch.advantages, self.adv_clip)
        log_ratio = as_float(batch.log_prob) - as_float(batch.old_log_prob).detach()
        with torch.no_grad():
            ratio = torch.exp(log_ratio)
            shift = sq_dist(batch.mean.detach(), batch.old_mean)
            std = per_sample(batch.std, ratio.shape[0]) if self.add_kl_coefficient else torch.ones_like(shift)
            divergence = shift / (2 * std**2)
            outside = ~(divergence < self.kl_mask_threshold)
            above = outside & (ratio > 1.0) & (advantages > 0)
            below = outside & (ratio < 1.0) & (advantages < 0)
            keep = ~(above | below)
        # a dropped sample's ratio is taken at log-ratio 0, so that one that overflowed gives no
        # inf * 0 = nan in the gradient (the reference's where() keeps the forward finite only)
        kept_ratio = torch.exp(torch.where(keep, log_ratio, log_ratio.new_zeros(())))
        policy_loss = torch.where(keep, -advantages * kept_ratio, log_ratio.new_zeros(())).mean()
        if self.kl_beta > 0:
            kl_value = kl_term(batch, self.kl_form)
            loss = policy_loss + self.kl_beta * kl_value
        else:  # no reference was computed: do not touch ref_* at all
            kl_value = policy_loss.new_zeros(())
            loss = policy_loss
        with torch.no_grad():
            r, dtype = ratio, ratio.dtype
            metrics = {
                "ratio_mean": r.mean(),
                "ratio_min": r.min(),
                "ratio_max": r.max(),
                "clipfrac": (~keep).to(dtype).mean(),
                "clipfrac_above": above.to(dtype).mean(),
                "clipfrac_below": below.to(dtype).mean(),
                "kl_mask_fraction": outside.to(dtype).mean(),
                "kl_new_old_mean": divergence.to(dtype).mean(),
                "kl_new_old_max": divergence.to(dtype).max(),
                "approx_kl": 0.5 * log_ratio.detach().pow(2).mean(),
                "policy_loss": policy_loss.detach(),
                "kl": kl_value.detach(),
                "loss": loss.detach(),
            }
        return ObjectiveOutput(loss=loss, metrics=metrics)
