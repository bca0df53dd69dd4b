"""Flow-GRPO's clipped policy objective (``objective: {name: grpo}``)."""

from __future__ import annotations

import attrs
import torch

from fgrpo.core.objectives._ppo import (
    ClippedObjective,
    clip_range_param,
    clipped_surrogate,
)
from fgrpo.core.protocols import StepBatch


@attrs.frozen
class GRPO(ClippedObjective):
    """PPO-clip on one trained denoising step, with group-relative advantages.

    ratio = exp(logp_new - logp_old); loss = mean_b max(-A r, -A clip(r, 1-ε, 1+ε)) + kl_beta * KL,
    with A clipped to ±adv_clip. KL (only when kl_beta > 0, to the adapter-disabled reference):
    ``mean`` = mean_b mean_dims (mu - mu_ref)^2 / (2 std^2), the exact KL per dimension between
    the two Gaussian steps; ``flow_grpo`` = the same divided by 2 g^2 = 2 std^2 / (-dt) instead
    of 2 std^2, i.e. (-dt) x ``mean`` (flow_grpo's form, for its published beta values);
    ``velocity`` = mean_b mean_dims (v - v_ref)^2 (DanceGRPO/MixGRPO style).
    """

    clip_range: float = clip_range_param(1e-4)

    def surrogate(
        self, batch: StepBatch, advantages: torch.Tensor, log_ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = torch.exp(log_ratio)
        return ratio, clipped_surrogate(ratio, advantages, self.clip_range).mean()
