"""DGPO (``objective: {name: dgpo}``): group preference optimization on forward-process points.

As Luo-Yihong/DGPO's ``scripts/train_sd3_dgpo.py`` (at 01ceb4b, ``compute_group_dgpo_loss_allreduce``
lines 162-192, called at 1096-1158) computes it, per group g of G samples re-noised at one (t, ε)
shared by the group (``use_shared_noise``; x_t = (1 - t) x0 + t ε, target ε - x0):

    e_i     = mean (v_θ(x_t,i) - (ε - x0_i))²,  e_ref,i likewise with the reference (adapter disabled)
    s_g     = Σ_{i∈g} A_i β (e_i - e_ref,i) / G                  (no gradient)
    loss    = mean_i sg[σ(s_g)] A_i e_i  +  beta mean_i (v_θ,i - v_ref,i)²

with A_i = clip(A_i, ±adv_clip). Its gradient is that of (G / β) mean_g -log σ(-s_g), the
Bradley-Terry log-likelihood of the group's positive set (A > 0) over its negative set (A < 0),
each sample weighted by |A_i|; ``group_nll`` reports that value (log 2 at θ = θ_ref).
Noise levels (``point_times``): ``timesteps`` distinct steps drawn uniformly from the first
``trunc_steps + 1`` of the rollout's schedule (the reference's ``random.sample(range(trunc_steps + 1),
num_train_timesteps)``), t = sigmas[j].
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.objectives._forward import dims_mean, velocity_kl
from fgrpo.core.objectives._ppo import adv_clip_param
from fgrpo.core.objectives.base import ForwardProcessObjective
from fgrpo.core.protocols import ForwardBatch, ObjectiveOutput


def group_ids(batch: ForwardBatch) -> torch.Tensor:
    """(b,) dense group index of each row; without ``groups`` the whole batch is one group."""
    if batch.groups is None:
        return torch.zeros(batch.velocity.shape[0], dtype=torch.long, device=batch.velocity.device)
    return torch.unique(batch.groups, return_inverse=True)[1].to(batch.velocity.device)


@attrs.frozen
class DGPO(ForwardProcessObjective):
    """DGPO's group-weighted flow-matching loss against the adapter-disabled reference (see the module
    docstring). Defaults from DGPO's ``config/dgpo.py``: beta_dpo 100, 4 points among the first 7
    steps (trunc_steps 6), adv_clip 5, KL weight 0 (GenEval: 0.02)."""

    dpo_beta: float = param(100.0, gt=0, help="β of s_g = Σ A_i β (e_i - e_ref,i) / G (config.train.beta_dpo)")
    beta: float = param(0.0, ge=0, help="weight of mean (v_θ - v_ref)² (config.train.beta); 0 = none")
    adv_clip: float = adv_clip_param()
    timesteps: int = param(4, ge=1, help="points per group (config.num_train_timesteps)")
    trunc_steps: int = param(6, ge=0, help="points are drawn among rollout steps 0..trunc_steps (config.trunc_steps)")

    grouped: ClassVar[bool] = True
    needs_reference: ClassVar[bool] = True

    def point_times(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        device = generator.device if generator is not None else torch.device("cpu")
        steps = min(self.trunc_steps + 1, sigmas.shape[0] - 1)
        index = torch.randperm(steps, generator=generator, device=device)[: self.timesteps]
        return sigmas[index.to(sigmas.device)]

    def __call__(self, batch: ForwardBatch) -> ObjectiveOutput:
        if batch.ref_velocity is None:
            raise ValueError("dgpo needs ForwardBatch.ref_velocity (the reference's prediction)")
        target = batch.target.float()
        adv = batch.advantages.float().clamp(-self.adv_clip, self.adv_clip)
        error = dims_mean((batch.velocity.float() - target) ** 2)
        ref_error = dims_mean((batch.ref_velocity.detach().float() - target) ** 2)
        groups = group_ids(batch)
        count = torch.zeros(int(groups.max()) + 1, device=error.device).index_add_(0, groups, torch.ones_like(error))
        term = adv * self.dpo_beta * (error.detach() - ref_error) / count[groups]
        s = torch.zeros_like(count).index_add_(0, groups, term)
        policy = (torch.sigmoid(s)[groups] * adv * error).mean()
        loss = policy + self.beta * velocity_kl(batch).mean() if self.beta else policy
        with torch.no_grad():
            metrics = {
                "loss": loss.detach(),
                "policy_loss": policy.detach(),
                "group_nll": -torch.nn.functional.logsigmoid(-s).mean(),
                "group_weight": torch.sigmoid(s).mean(),
                "model_err": error.mean().detach(),
                "ref_err": ref_error.mean(),
            }
        return ObjectiveOutput(loss=loss, metrics=metrics)
