"""Flow-GRPO's clipped policy objective (``objective: {name: grpo}``)."""

from __future__ import annotations

import attrs
import torch

from fgrpo.core.objectives._ppo import (
    KlForm,
    adv_clip_param,
    as_float,
    assemble,
    beta_param,
    clip_advantages,
    clip_range_param,
    clipped_surrogate,
    kl_param,
    kl_recipe_errors,
)
from fgrpo.core.config import ConfigError
from fgrpo.core.protocols import ObjectiveOutput, StepBatch


@attrs.frozen
class GRPO:
    """PPO-clip on one trained denoising step, with group-relative advantages.

    ratio = exp(logp_new - logp_old); loss = mean_b max(-A r, -A clip(r, 1-ε, 1+ε)) + beta * KL,
    with A clipped to ±adv_clip. KL (only when beta > 0, to the adapter-disabled reference):
    ``mean`` = mean_b mean_dims (mu - mu_ref)^2 / (2 std^2), the exact KL per dimension between
    the two Gaussian steps; ``flow_grpo`` = the same divided by 2 g^2 = 2 std^2 / (-dt) instead
    of 2 std^2, i.e. (-dt) x ``mean`` (flow_grpo's form, for its published beta values);
    ``velocity`` = mean_b mean_dims (v - v_ref)^2 (DanceGRPO/MixGRPO style).
    """

    clip_range: float = clip_range_param(1e-4)
    adv_clip: float = adv_clip_param()
    beta: float = beta_param()
    kl: KlForm = kl_param()

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    @staticmethod
    def check_recipe(resolved: dict) -> list[ConfigError]:
        return kl_recipe_errors(resolved)

    def __call__(self, batch: StepBatch) -> ObjectiveOutput:
        advantages = clip_advantages(batch.advantages, self.adv_clip)
        log_ratio = as_float(batch.log_prob) - as_float(batch.old_log_prob).detach()
        ratio = torch.exp(log_ratio)
        policy_loss = clipped_surrogate(ratio, advantages, self.clip_range).mean()
        return assemble(
            policy_loss, ratio, log_ratio, batch,
            clip_range=self.clip_range, beta=self.beta, kl=self.kl,
        )
