"""Online Flow-DPO (``objective: {name: dpo}``): Diffusion-DPO on pairs formed inside each group.

As ltt0716/flow_grpo_official's ``scripts/train_sd3_dpo.py`` (at f9a5c45, lines 864-931) computes
it, per pair (x0_w preferred, x0_l rejected, one prompt) and training point (t, ε shared by the
pair, x_t = (1 - t) x0 + t ε):

    e_θ(x0) = mean (v_θ(x_t) - (ε - x0))²,  e_ref likewise with the reference (adapter disabled)
    loss    = mean_points -log σ(-β/2 ((e_θ(w) - e_ref(w)) - (e_θ(l) - e_ref(l))))

Pairs (``pairing``): ``best_worst`` = each group's highest- and lowest-advantage samples (the first
of each on ties; flow_grpo's ``PerPromptStatTracker.update(type='dpo')``), ``all`` = every pair of
a group with different advantages, ordered; a group whose samples all score the same gives no pair
(flow_grpo then trains samples 1 and 0 as a pair of equals). Noise levels: t = shift(1 - ⌊1000 u⌋ /
1000) with u = sigmoid(N(logit_mean, logit_std²)) (diffusers' logit-normal density over the 1000
timesteps of FlowMatchEulerDiscreteScheduler with ``shift``), int(steps x 0.99) points per pair,
each with its own t and noise (flow_grpo's loop over ``num_train_timesteps``).

At θ = θ_ref (an adapter that starts at zero) the inner term is 0 and the gradient is β/4 times
the flow-matching gradient of the preferred sample minus that of the rejected one (tested).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.objectives._forward import (
    dims_mean,
    fraction_count,
    logit_normal,
    shift,
    timestep_fraction_param,
)
from fgrpo.core.objectives.base import ForwardProcessObjective
from fgrpo.core.protocols import ForwardBatch, ObjectiveOutput

Pairing = Literal["best_worst", "all"]


def best_worst(advantages: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(P, 2) (preferred, rejected) sample indices: each group's first argmax and first argmin;
    flat groups give none."""
    pairs = []
    for g in torch.unique(groups, sorted=True).tolist():
        members = (groups == g).nonzero().squeeze(1)
        a = advantages[members]
        hi, lo = int(torch.argmax(a)), int(torch.argmin(a))
        if a[hi] > a[lo]:
            pairs.append((int(members[hi]), int(members[lo])))
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


def all_pairs(advantages: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(P, 2) every (i, j) of one group with advantage_i > advantage_j, in index order."""
    pairs = []
    for g in torch.unique(groups, sorted=True).tolist():
        members = (groups == g).nonzero().squeeze(1).tolist()
        pairs += [(i, j) for i in members for j in members if advantages[i] > advantages[j]]
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


@attrs.frozen
class DPO(ForwardProcessObjective):
    """Diffusion-DPO on (preferred, rejected) pairs of a group, reference = adapters disabled (see
    the module docstring). Defaults from flow_grpo's ``config/dpo.py`` (beta 100: ``dpo_beta``, timestep_fraction
    0.99) and ``train_sd3_dpo.py`` (logit-normal t with mean 0, std 1 on SD3.5's shift-3 schedule)."""

    dpo_beta: float = param(
        100.0, gt=0, help="β of -log σ(-β/2 ((e_w - e_ref,w) - (e_l - e_ref,l))) (config.train.beta)"
    )
    pairing: Pairing = param(
        "best_worst",
        choices=("best_worst", "all"),
        help="pairs of a group: its best and worst sample, or every pair with different advantages",
    )
    timestep_fraction: float = timestep_fraction_param(0.99, "flow_grpo num_train_timesteps = int(40 x 0.99)")
    logit_mean: float = param(0.0, help="mean of the logit-normal t density")
    logit_std: float = param(1.0, gt=0, help="std of the logit-normal t density")
    shift: float = param(
        3.0, gt=0, help="time shift of the 1000-step training schedule t is drawn on (SD3.5's scheduler: 3)"
    )
    train_timesteps: int = param(
        1000, ge=1, help="steps of the training schedule (FlowMatchEulerDiscreteScheduler num_train_timesteps)"
    )

    pairwise: ClassVar[bool] = True
    #: the key's name before it meant one thing across objectives (``beta`` is a KL weight elsewhere)
    renamed_keys: ClassVar[dict[str, str]] = {"beta": "dpo_beta"}
    needs_reference: ClassVar[bool] = True

    def pairs(self, advantages: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        advantages, groups = advantages.detach().cpu(), groups.detach().cpu()
        return all_pairs(advantages, groups) if self.pairing == "all" else best_worst(advantages, groups)

    def point_times(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        device = generator.device if generator is not None else torch.device("cpu")
        count = fraction_count(sigmas.shape[0] - 1, self.timestep_fraction)
        u = logit_normal(count, self.logit_mean, self.logit_std, generator, device)
        index = (u * self.train_timesteps).long()
        t = shift((self.train_timesteps - index).double() / self.train_timesteps, self.shift)
        return t.to(device=sigmas.device, dtype=sigmas.dtype)

    def __call__(self, batch: ForwardBatch) -> ObjectiveOutput:
        if batch.ref_velocity is None:
            raise ValueError("dpo needs ForwardBatch.ref_velocity (the reference's prediction)")
        m = batch.velocity.shape[0] // 2
        target = batch.target.float()
        error = dims_mean((batch.velocity.float() - target) ** 2)
        ref_error = dims_mean((batch.ref_velocity.detach().float() - target) ** 2)
        w_diff = error[:m] - ref_error[:m]
        l_diff = error[m:] - ref_error[m:]
        inside = -0.5 * self.dpo_beta * (w_diff - l_diff)
        loss = -torch.nn.functional.logsigmoid(inside).mean()
        with torch.no_grad():
            metrics = {
                "loss": loss.detach(),
                "policy_loss": loss.detach(),
                "model_w_err": error[:m].mean().detach(),
                "model_l_err": error[m:].mean().detach(),
                "ref_w_err": ref_error[:m].mean(),
                "ref_l_err": ref_error[m:].mean(),
                "implicit_acc": (inside > 0).float().mean().detach(),
            }
        return ObjectiveOutput(loss=loss, metrics=metrics)
