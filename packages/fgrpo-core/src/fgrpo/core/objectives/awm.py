"""Advantage Weighted Matching (``objective: {name: awm}``): the flow-matching loss weighted by the
advantage, as scxue/advantage_weighted_matching computes it (``scripts/train_sd3_awm.py`` at
be51372: ``compute_log_prob_awm`` lines 210-252, the loss lines 1292-1352, the KL-EMA policy
lines 649-659 and 1409-1419, the noise levels lines 1138-1207).

Per training point (x0 with advantage A, re-noised at t; m = mean (v_θ - (ε - x0))², in float64):

    log p = -m x w(t, m):  Uniform: -m;  t: -m t;  t**2: -m t²;
            huber: -(sqrt(m + 1e-10) - 1e-5) t;  ghuber: -((m + 1e-10)^p - 1e-10^p) t / p
    Â     = clip(A, ±adv_clip) / adv_clip x advantage_max
    ratio = exp(log p - sg(log p))                          # = 1: the update is on-policy
    loss  = mean max(-Â ratio, -Â clip(ratio, 1 ± clip_range))
            + kl_beta mean (v_θ - v_ref)² [/ (2 s²)]  + ema_kl_beta mean (v_θ - v_ema)² [/ (2 s²)]

with s = 0.7 sqrt(t / (1 - clamp(t, 0, 0.99))) for the ``ELBO`` KL forms (``kl_form``,
``ema_kl_form``). v_ema is AWM's lagged "ema" adapter (a KL anchor, not the sampling policy:
rollouts use the current weights), moved after every iteration to ema <- d ema + (1 - d) θ with
d = min(kl_ema_decay, 0.001 n) after n optimizer steps (``kl_ema_decay_type: linear``) or
d = kl_ema_decay (``constant``).

The reference's first two epochs only draw prompts (``if epoch < 2: continue`` before sampling and
before training, train_sd3_awm.py:880-881 and 936-937, "the group size collected in the first two
epochs has a bug"): ``idle_iterations: 2`` does the same (fgrpo's iteration is the reference's
epoch), default 0.

The reference's ratio uses, after the first optimizer step of an iteration, the log-probs of the
weights the iteration started with; its configs make one optimizer step per iteration, where that
is exactly this (``off_policy: False``); fgrpo's ratio is 1 at every step (docs/method.md).

At θ = θ_old the gradient is the advantage-weighted flow-matching gradient times the weighting's
derivative: d loss / d v = w'(t, m) x d/dv [Â m] with w' = 1 (Uniform), t, t², t / (2 sqrt(m + 1e-10))
(huber), t (m + 1e-10)^(p - 1) (ghuber) (tested).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.objectives._forward import (
    dims_mean,
    discrete_indices,
    linear_decay,
    normal_icdf,
    shift,
    timestep_fraction_param,
)
from fgrpo.core.objectives._ppo import adv_clip_param, as_float, clipped_surrogate
from fgrpo.core.objectives.base import ForwardProcessObjective
from fgrpo.core.protocols import ForwardBatch, ObjectiveOutput

Weighting = Literal["Uniform", "t", "t**2", "huber", "ghuber"]
WEIGHTINGS = ("Uniform", "t", "t**2", "huber", "ghuber")
KL_WEIGHTS = ("Uniform", "ELBO")
TIME_TYPES = ("discrete_wo_init", "discrete", "discrete_with_init", "uniform", "logit_normal")
EPS = 1e-10


def weighted_log_prob(m: torch.Tensor, t: torch.Tensor, weighting: str, power: float) -> torch.Tensor:
    """(b,) AWM's per-point "log-prob" of the flow-matching error m (train_sd3_awm.py:238-251)."""
    t = t.to(m.dtype)
    if weighting == "Uniform":
        return -m
    if weighting == "t":
        return -m * t
    if weighting == "t**2":
        return -m * t**2
    if weighting == "huber":
        return -(torch.sqrt(m + EPS) - 1e-5) * t
    floor = torch.tensor(EPS, dtype=m.dtype, device=m.device) ** power
    return -(torch.pow(m + EPS, power) - floor) * t / power


def elbo_std(t: torch.Tensor) -> torch.Tensor:
    """AWM's std_dev_t = 0.7 sqrt(t / (1 - clamp(t, 0, 0.99))) of the ELBO KL weighting."""
    return torch.sqrt(t / (1 - torch.clamp(t, 0, 0.99))) * 0.7


@attrs.frozen
class AWM(ForwardProcessObjective):
    """Advantage-weighted matching (see the module docstring). Defaults from AWM's GenEval config
    (``config/dgx_awm.py:31-98``): ghuber weighting with power 0.25, advantages clipped at 5 and
    scaled to ±1, KL beta 0.001 (OCR 0.003, PickScore 1e-4), the KL-EMA anchor with weight 1 and a
    linear decay capped at 0.3, 6 stratified discrete points per sample from the first 90% of the
    rollout's steps without the first one (PickScore: ``discrete``, with it)."""

    weighting: Weighting = param(
        "ghuber", choices=WEIGHTINGS, help="w(t, m) of the flow-matching error: Uniform, t, t**2, huber, ghuber"
    )
    ghuber_power: float = param(0.25, gt=0, help="p of the ghuber weighting -((m + 1e-10)^p - 1e-10^p) t / p")
    adv_clip: float = adv_clip_param()
    advantage_max: float = param(1.0, gt=0, help="advantages are clipped to ±adv_clip, then scaled to ±advantage_max")
    clip_range: float = param(1.0, gt=0, help="PPO clip of the ratio (1 = the reference's; the ratio is 1 on-policy)")
    kl_beta: float = param(
        0.001, ge=0, help="weight of the KL to the adapter-disabled reference (config.train.beta); 0 = none"
    )
    kl_form: str = param(
        "Uniform",
        choices=KL_WEIGHTS,
        help="KL form: Uniform = mean (v - v_ref)², ELBO = that / (2 s²) (config.train.kl_weight)",
    )
    ema_kl_beta: float = param(
        1.0, ge=0, help="weight of the KL to AWM's lagged 'ema' policy (config.train.ema_beta); 0 = none"
    )
    ema_kl_form: str = param(
        "Uniform",
        choices=KL_WEIGHTS,
        help="form of the KL to the lagged policy (Uniform or ELBO; config.train.kl_ema_weight)",
    )
    kl_ema_decay: float = param(
        0.3, ge=0, lt=1, help="the lagged policy's decay: at most this (linear) or this (constant)"
    )
    kl_ema_decay_type: str = param(
        "linear", choices=("linear", "constant"), help="linear: min(kl_ema_decay, 0.001 n) after n optimizer steps"
    )
    time_type: str = param(
        "discrete_wo_init", choices=TIME_TYPES, help="how the points' noise levels are drawn (config.time_type)"
    )
    train_timesteps: int = param(6, ge=1, help="points per sample (config.train.train_timesteps)")
    timestep_fraction: float = timestep_fraction_param(
        0.9, "discrete types draw from the first int(steps x fraction) steps; AWM 0.9"
    )
    time_shift: float = param(
        3.0, gt=0, help="uniform and logit_normal: the time shift of the drawn t (config.time_shift)"
    )
    idle_iterations: int = param(
        0,
        ge=0,
        help="the first iterations only spend their prompts: no rollout, no update, no move of the lagged "
        "policy (the reference idles its epochs 0-1: 2)",
    )
    #: the keys' names before they meant one thing across objectives
    renamed_keys: ClassVar[dict[str, str]] = {
        "beta": "kl_beta",
        "kl_weight": "kl_form",
        "ema_beta": "ema_kl_beta",
        "kl_ema_weight": "ema_kl_form",
    }

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    @property
    def needs_old(self) -> bool:
        return self.ema_kl_beta > 0

    def old_decay(self, optimizer_steps: int) -> float:
        if self.kl_ema_decay_type == "constant":
            return self.kl_ema_decay
        return linear_decay(optimizer_steps, 0, 0.001, self.kl_ema_decay)

    def point_times(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """``train_timesteps`` noise levels (train_sd3_awm.py:1138-1207), for one sample."""
        k = self.train_timesteps
        device = generator.device if generator is not None else torch.device("cpu")
        last = int((sigmas.shape[0] - 1) * self.timestep_fraction)
        if self.time_type.startswith("discrete"):
            if self.time_type == "discrete":
                index = discrete_indices(0, last, k, generator, device)
            elif self.time_type == "discrete_wo_init":
                index = discrete_indices(1, last, k, generator, device)
            else:  # discrete_with_init: the first step, then k - 1 strata of [1, last]
                rest = discrete_indices(1, last, k - 1, generator, device) if k > 1 else index_none(device)
                index = torch.cat([torch.zeros(1, dtype=torch.long, device=device), rest])
            return sigmas[index.to(sigmas.device)]
        strata = (torch.arange(k, device=device) + torch.rand(k, generator=generator, device=device)) / k
        order = torch.randperm(k, generator=generator, device=device)
        if self.time_type == "uniform":
            t = shift(0.2 + strata[order] * 0.8, self.time_shift)
        else:  # logit_normal: stratified normal quantiles
            t = shift(torch.sigmoid(normal_icdf(strata)[order]), self.time_shift).clamp(min=0.01)
        return t.to(device=sigmas.device, dtype=sigmas.dtype)

    def __call__(self, batch: ForwardBatch) -> ObjectiveOutput:
        v = batch.velocity
        m = dims_mean((v.double() - batch.target.double()) ** 2)
        log_prob = weighted_log_prob(m, as_float(batch.t).double(), self.weighting, self.ghuber_power)
        advantages = as_float(batch.advantages).detach().double().clamp(-self.adv_clip, self.adv_clip)
        advantages = advantages / self.adv_clip * self.advantage_max
        ratio = torch.exp(log_prob - log_prob.detach())
        policy_loss = clipped_surrogate(ratio, advantages, self.clip_range).mean()
        kl = self._kl(batch, batch.ref_velocity, self.kl_form) if self.kl_beta > 0 else policy_loss.new_zeros(())
        ema_kl = (
            self._kl(batch, batch.old_velocity, self.ema_kl_form)
            if self.ema_kl_beta > 0
            else policy_loss.new_zeros(())
        )
        loss = policy_loss + self.kl_beta * kl + self.ema_kl_beta * ema_kl
        with torch.no_grad():
            metrics = {
                "policy_loss": policy_loss.detach(),
                "kl": kl.detach(),
                "ema_kl": ema_kl.detach(),
                "flow_error": m.mean().detach(),
                "ratio_mean": ratio.detach().mean(),
                "loss": loss.detach(),
            }
        return ObjectiveOutput(loss=loss, metrics=metrics)

    @staticmethod
    def _kl(batch: ForwardBatch, other: torch.Tensor | None, form: str) -> torch.Tensor:
        if other is None:
            raise ValueError(
                "awm's KL terms need ForwardBatch.ref_velocity / old_velocity (see needs_reference, needs_old)"
            )
        kl = dims_mean((batch.velocity.double() - other.detach().double()) ** 2)
        if form == "ELBO":
            kl = kl / (2 * elbo_std(as_float(batch.t).double()) ** 2)
        return kl.mean()


def index_none(device: torch.device) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long, device=device)
