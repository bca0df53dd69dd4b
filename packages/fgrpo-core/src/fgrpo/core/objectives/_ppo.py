"""What the GRPO objectives share: their recipe keys, the clipped surrogate, the KL term, metrics.

Everything here works per trained step on a minibatch of b samples (a :class:`StepBatch`).
Per-sample quantities are kept as (b,) vectors so that an objective can weight samples before
averaging (GRPO-Guard divides each sample's loss by its own -dt).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import torch

from fgrpo.core import registry
from fgrpo.core.config import ConfigError, param
from fgrpo.core.objectives.base import TransitionObjective
from fgrpo.core.protocols import ObjectiveOutput, StepBatch

KlForm = Literal["mean", "flow_grpo", "velocity"]
KL_FORMS = ("mean", "flow_grpo", "velocity")


# --- recipe keys (declared once, used by every objective) ---------------------------------------


def clip_range_param(default: float):
    return param(default, gt=0, help="PPO clip ε: the ratio only acts inside [1 - ε, 1 + ε]")


def adv_clip_param():
    return param(5.0, gt=0, help="advantages are clipped to ±adv_clip")


def kl_beta_param():
    return param(0.0, ge=0, help="weight of the KL term to the reference policy (LoRA off); 0 = none")


def kl_form_param():
    return param(
        "mean",
        choices=KL_FORMS,
        help="KL form: 'mean' = (mu - mu_ref)^2 / (2 std^2), the exact KL; 'flow_grpo' = (mu - mu_ref)^2 / "
        "(2 g^2) with g = std / sqrt(-dt), i.e. (-dt) x the exact KL (flow_grpo's, so its beta values carry "
        "over); 'velocity' = (v - v_ref)^2",
    )


# --- rules between the objective and the sampler (checked when a recipe is validated) ----------


def kernel_spec(resolved: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The resolved ``sampler.kernel`` mapping of a recipe, if it is one."""
    sampler = resolved.get("sampler")
    kernel = sampler.get("kernel") if isinstance(sampler, Mapping) else None
    return kernel if isinstance(kernel, Mapping) and isinstance(kernel.get("name"), str) else None


def kl_recipe_errors(resolved: Mapping[str, Any]) -> list[ConfigError]:
    """``kl_form: flow_grpo`` divides by 2 g^2 with g = std / sqrt(-dt): defined for kernels whose step
    std is g sqrt(-dt) (``brownian``: sde, dance). With ``cps`` flow_grpo divides by the full std,
    which is the exact KL: ``kl_form: mean``."""
    objective, kernel = resolved.get("objective") or {}, kernel_spec(resolved)
    if objective.get("kl_form") != "flow_grpo" or not objective.get("kl_beta") or kernel is None:
        return []
    if getattr(registry.load("kernel", kernel["name"]), "brownian", False):
        return []
    return [
        ConfigError(
            "objective.kl_form",
            f"got 'flow_grpo' with the kernel {kernel['name']!r}, whose std is not g * sqrt(-dt); flow_grpo "
            "divides its KL by the kernel's full std there, which is the exact KL: use kl_form: mean",
        )
    ]


# --- pieces of the loss ---------------------------------------------------------------------------


def as_float(x: torch.Tensor) -> torch.Tensor:
    # Ratios of half-precision log-probs are meaningless at ε ~ 1e-4; float64 stays (tests, checks).
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def per_sample(x: torch.Tensor, b: int) -> torch.Tensor:
    """(b,) view of a per-sample scalar that may arrive broadcastable, e.g. (b, 1, 1, 1)."""
    return as_float(x).reshape(b)


def sq_dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(b,) squared distance averaged over all non-batch dims (log-probs are averaged too)."""
    return (as_float(a) - as_float(b)).pow(2).flatten(1).mean(1)


def clip_advantages(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    return as_float(advantages).detach().clamp(-adv_clip, adv_clip)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> torch.Tensor:
    """(b,) pessimistic PPO loss max(-A r, -A clip(r, 1-ε, 1+ε)); no gradient where the clip binds."""
    clipped = ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(-advantages * ratio, -advantages * clipped)


def kl_term(batch: StepBatch, form: str) -> torch.Tensor:
    """Scalar KL to the reference, with gradient through the current mean / velocity only."""
    b = batch.log_prob.shape[0]
    if form in ("mean", "flow_grpo"):
        if batch.ref_mean is None:
            raise ValueError(f"kl_beta > 0 with kl_form={form!r} needs StepBatch.ref_mean (see needs_reference)")
        std = per_sample(batch.std, b).detach()
        exact = sq_dist(batch.mean, batch.ref_mean.detach()) / (2 * std**2)
        if form == "flow_grpo":  # divided by 2 g^2 = 2 std^2 / (-dt) instead of 2 std^2
            exact = exact * -per_sample(batch.dt, b).detach()
        return exact.mean()
    if form == "velocity":
        if batch.velocity is None or batch.ref_velocity is None:
            raise ValueError("kl_beta > 0 with kl_form='velocity' needs StepBatch.velocity and ref_velocity")
        return sq_dist(batch.velocity, batch.ref_velocity.detach()).mean()
    raise ValueError(f"unknown kl form {form!r}; allowed: {', '.join(map(repr, KL_FORMS))}")


@attrs.frozen
class ClippedObjective(TransitionObjective):
    """What ``grpo`` and ``grpo-guard`` share around their surrogates: the recipe keys ``adv_clip``,
    ``kl_beta`` and ``kl_form``, the reference only for a KL (``kl_beta > 0``), the clipped advantages, the
    raw log-ratio, the KL term and the metrics. A subclass (an attrs class) adds its
    ``clip_range`` key (its own default) and writes :meth:`surrogate`."""

    if TYPE_CHECKING:  # each subclass's own recipe key (its own default); not a field here
        clip_range: float
    adv_clip: float = adv_clip_param()
    kl_beta: float = kl_beta_param()
    kl_form: KlForm = kl_form_param()
    #: the keys' names before they meant one thing across objectives
    renamed_keys: ClassVar[dict[str, str]] = {"beta": "kl_beta", "kl": "kl_form"}

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    @staticmethod
    def check_recipe(resolved: Mapping[str, Any]) -> list[ConfigError]:
        return kl_recipe_errors(resolved)

    def surrogate(
        self, batch: StepBatch, advantages: torch.Tensor, log_ratio: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the (b,) ratios the clip acts on, the scalar policy loss)."""
        raise NotImplementedError

    def __call__(self, batch: StepBatch) -> ObjectiveOutput:
        advantages = clip_advantages(batch.advantages, self.adv_clip)
        log_ratio = as_float(batch.log_prob) - as_float(batch.old_log_prob).detach()
        ratio, policy_loss = self.surrogate(batch, advantages, log_ratio)
        return assemble(
            policy_loss,
            ratio,
            log_ratio,
            batch,
            clip_range=self.clip_range,
            kl_beta=self.kl_beta,
            kl_form=self.kl_form,
        )


def assemble(
    policy_loss: torch.Tensor,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    batch: StepBatch,
    *,
    clip_range: float,
    kl_beta: float,
    kl_form: str,
) -> ObjectiveOutput:
    """Add the KL term and collect the metrics; ``log_ratio`` is the raw logp_new - logp_old."""
    if kl_beta > 0:
        kl_value = kl_term(batch, kl_form)
        loss = policy_loss + kl_beta * kl_value
    else:  # no reference was computed: do not touch ref_* at all
        kl_value = policy_loss.new_zeros(())
        loss = policy_loss
    # Metrics stay on the device as 0-d tensors: no host sync inside the step loop.
    with torch.no_grad():
        r = ratio.detach()
        above = (r > 1.0 + clip_range).to(r.dtype).mean()
        below = (r < 1.0 - clip_range).to(r.dtype).mean()
        metrics = {
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
            "clipfrac": above + below,
            "clipfrac_above": above,
            "clipfrac_below": below,
            "approx_kl": 0.5 * log_ratio.detach().pow(2).mean(),
            "policy_loss": policy_loss.detach(),
            "kl": kl_value.detach(),
            "loss": loss.detach(),
        }
    return ObjectiveOutput(loss=loss, metrics=metrics)
