"""DiffusionNFT (``objective: {name: nft}``): negative-aware fine-tuning on the forward process.

As NVlabs/DiffusionNFT computes it (``scripts/train_nft_sd3.py`` at 24af555, lines 910-978), per
training point (a finished sample x0 with advantage A, re-noised at t: x_t = (1 - t) x0 + t eps):

    Â  = clip(A, ±a) (``adv_mode`` may then keep one sign, or map it to {0, 1} or {-1, 1})
    r  = clip(Â / a / 2 + 1/2, 0, 1)                       # a = adv_clip (adv_clip_max)
    v⁺ = β v_θ + (1 - β) v_old,   v⁻ = (1 + β) v_old - β v_θ  # v_old: the sampling ("old") policy
    x̂⁺ = x_t - t v⁺,  w⁺ = mean |x̂⁺ - x0| (no gradient, floored at 1e-5),  L⁺ = mean (x̂⁺ - x0)² / w⁺
    x̂⁻ = x_t - t v⁻,  w⁻ likewise,                                        L⁻ = mean (x̂⁻ - x0)² / w⁻
    loss = mean_points a (r L⁺ + (1 - r) L⁻) / β  +  kl_beta mean (v_θ - v_ref)²

(the means inside are over a sample's dimensions; the factor a is the reference's). The old policy
is a lagged copy of the trained weights that the rollouts come from, moved after every iteration
to old <- d old + (1 - d) θ with d = min((n - flat) x rate, cap) after n optimizer steps (the
reference's ``return_decay``; ``decay_type`` 0: d = 0, 1: flat 0, rate 0.001, cap 0.5, 2: flat 75,
rate 0.0075, cap 0.999). The points of a sample are int(steps x 0.99) distinct noise levels of the
rollout's own schedule in random order (the reference: a permutation of the scheduler's
timesteps per sample, the first ``num_train_timesteps`` of it), each with its own noise.

At θ = θ_old (v_θ = v_old) the gradient is the advantage-weighted flow-matching gradient scaled by
t / mean|ε - x0 - v|: d loss / d v_θ = (t / mean|u - v|) x d/dv [Â mean (v - u)²], u = ε - x0, for
every β and a (docs/method.md derives it; tested).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.objectives._forward import (
    dims_mean,
    fraction_count,
    linear_decay,
    per_row,
    timestep_fraction_param,
    velocity_kl,
)
from fgrpo.core.objectives._ppo import adv_clip_param, as_float
from fgrpo.core.objectives.base import ForwardProcessObjective
from fgrpo.core.protocols import ForwardBatch, ObjectiveOutput

AdvMode = Literal["all", "positive_only", "negative_only", "one_only", "binary"]
ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
#: decay_type -> (flat, rate, cap) of ``return_decay`` (train_nft_sd3.py:169-189)
DECAY_TYPES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
#: the floor of the adaptive weight (train_nft_sd3.py:945)
WEIGHT_FLOOR = 1e-5


def advantage_mode(advantages: torch.Tensor, mode: str, clip: float) -> torch.Tensor:
    """The clipped advantages as ``adv_mode`` uses them (train_nft_sd3.py:910-925)."""
    a = as_float(advantages).detach().clamp(-clip, clip)
    if mode == "positive_only":
        return a.clamp(0, clip)
    if mode == "negative_only":
        return a.clamp(-clip, 0)
    if mode == "one_only":
        return (a > 0).to(a.dtype)
    if mode == "binary":
        return torch.sign(a)
    return a


def x0_loss(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """(b,) mean (x̂0 - x0)² / w with the adaptive weight w = mean |x̂0 - x0| (float64, no gradient)."""
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().flatten(1).mean(1).clamp(min=WEIGHT_FLOOR)
    return dims_mean((x0_hat - x0) ** 2 / per_row(weight, x0_hat.double()))


@attrs.frozen
class NFT(ForwardProcessObjective):
    """DiffusionNFT's loss on forward-process points, with its old (sampling) policy (see the
    module docstring). Defaults from ``config/nft.py`` (``_get_config``): beta 1.0 (``nft_beta``),
    adv_clip 5, adv_mode all, kl_beta 1e-4, decay_type 1; its OCR and multi-reward configs use beta
    0.1 (and OCR decay_type 2)."""

    nft_beta: float = param(
        1.0, gt=0, help="β of v⁺ = β v_θ + (1 - β) v_old, v⁻ = (1 + β) v_old - β v_θ (config.beta)"
    )
    adv_clip: float = adv_clip_param()
    adv_mode: AdvMode = param(
        "all",
        choices=ADV_MODES,
        help="which advantages count: all, positive_only, negative_only, one_only (A > 0 -> 1, else 0), binary (sign)",
    )
    kl_beta: float = param(
        1e-4,
        ge=0,
        help="weight of mean (v_θ - v_ref)² to the adapter-disabled reference (config.train.beta); 0 = none",
    )
    decay_type: int = param(
        1,
        choices=(0, 1, 2),
        help="the old policy's decay after n optimizer steps: 0 = none (old = current), 1 = min(0.001 n, 0.5), 2 = "
        "min(0.0075 (n - 75), 0.999) after 75 flat steps",
    )
    timestep_fraction: float = timestep_fraction_param(0.99, "DiffusionNFT config.train.timestep_fraction 0.99")

    samples_from_old: ClassVar[bool] = True
    #: the key's name before it meant one thing across objectives (``beta`` is a KL weight elsewhere)
    renamed_keys: ClassVar[dict[str, str]] = {"beta": "nft_beta"}

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    @property
    def needs_old(self) -> bool:
        return True

    def old_decay(self, optimizer_steps: int) -> float:
        return linear_decay(optimizer_steps, *DECAY_TYPES[self.decay_type])

    def point_times(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """int(T x fraction) distinct levels of the rollout's schedule sigmas[:-1], in random order."""
        steps = sigmas.shape[0] - 1
        device = generator.device if generator is not None else torch.device("cpu")
        order = torch.randperm(steps, generator=generator, device=device)[
            : fraction_count(steps, self.timestep_fraction)
        ]
        return sigmas[:-1][order.to(sigmas.device)]

    def __call__(self, batch: ForwardBatch) -> ObjectiveOutput:
        if batch.old_velocity is None:
            raise ValueError("nft needs ForwardBatch.old_velocity (the old policy's prediction)")
        clip = self.adv_clip
        r = (advantage_mode(batch.advantages, self.adv_mode, clip) / clip / 2.0 + 0.5).clamp(0, 1)
        v, v_old = batch.velocity, batch.old_velocity.detach()
        positive = self.nft_beta * v + (1 - self.nft_beta) * v_old
        negative = (1.0 + self.nft_beta) * v_old - self.nft_beta * v
        t = per_row(batch.t, v)
        positive_loss = x0_loss(batch.x_t - t * positive, batch.x0)
        negative_loss = x0_loss(batch.x_t - t * negative, batch.x0)
        unweighted = r * positive_loss / self.nft_beta + (1.0 - r) * negative_loss / self.nft_beta
        policy_loss = (unweighted * clip).mean()
        kl = velocity_kl(batch).mean() if self.kl_beta > 0 else policy_loss.new_zeros(())
        loss = policy_loss + self.kl_beta * kl
        with torch.no_grad():
            metrics = {
                "policy_loss": policy_loss.detach(),
                "unweighted_policy_loss": unweighted.mean().detach(),
                "kl": kl.detach(),
                "old_deviation": dims_mean((v.detach() - v_old) ** 2).mean(),
                "r_mean": r.mean(),
                "loss": loss.detach(),
            }
        return ObjectiveOutput(loss=loss, metrics=metrics)
