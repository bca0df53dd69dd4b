"""``tempflow`` (TempFlow-GRPO): trajectory branching at one step per rollout, noise-aware weights.

As the paper (He et al., arXiv 2508.04324, ICLR'26, §3 "trajectory branching" and "noise-aware
weighting"; its authors' repository Shredded-Pork/TempFlow-GRPO @ afe6d33 ships no code, and
Tencent-Hunyuan/UniRL @ 1a7b501 has no ``tempflowgrpo.py``: see docs/method.md) and the authors'
description of their implementation (Shredded-Pork/TempFlow-GRPO issues #1 and #3): the samples
of a group start from the same noise (the paper's "seed group") and share ONE Euler ODE trajectory
up to the branching step k; at k each takes its own stochastic kernel step (the only recorded,
trained transition, ``step_index`` (B, 1) = k), then Euler ODE steps to the end, so a sample's
reward is credited to its step k alone. The reference branches every step 0 .. T - 2 of every
seed in turn; here one rollout branches at one step k drawn uniformly from ``branch_range``
(default [0, steps - 1]) with the rollout's generator before anything else (seeded, resumes
bit-exactly), so over rollouts every step is branched as often in expectation.

Noise-aware weight: the policy loss of the step is multiplied by w_k = s_k / mean_j s_j, s_j the
kernel's std at step j (the paper's sigma_t sqrt(dt), for ``sde`` g sqrt(-dt)) and j over the
candidate steps of ``branch_range`` with s_j > 0: high-noise steps weigh more, and the weights
average 1 over the branching steps (issue #1: "we normalize the policy loss to mean as 1"; the KL
term is not weighted). It is recorded as the trajectory's ``policy_weight``, which every
transition objective (``grpo``, ``grpo-guard``, ...) multiplies into the step's advantage; for
w > 0 that is the clipped loss times w. ``noise_weight: false`` is the paper's "branching only"
ablation (weight 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core.config import ConfigError, param
from fgrpo.core.protocols import Policy, Trajectory
from fgrpo.core.registry import component
from fgrpo.samplers.base import (
    EULER,
    GroupSampler,
    Plan,
    Step,
    drawn_range,
    final_param,
    kl_steps_param,
    randint,
    schedule_param,
    step_range_errors,
)


def noise_weights(stds: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """(S,) the noise-aware weight of every step: s_j / mean(s over low .. high - 1 where s > 0),
    0 outside that range or where s = 0."""
    weights = torch.zeros_like(stds, dtype=torch.float32)
    span = stds[low:high].float()
    live = span[span > 0]
    if live.numel():
        weights[low:high] = torch.where(span > 0, span / live.mean(), torch.zeros_like(span))
    return weights


@attrs.define
class TempFlowSampler(GroupSampler):
    """TempFlow-GRPO: the group shares an ODE trajectory up to a branching step drawn in
    ``branch_range``, where each sample takes its own stochastic, trained step, weighted by its
    noise level (see the module docstring)."""

    steps: int = param(10, ge=1, help="sampling steps")
    branch_range: list[int] | None = param(
        None,
        help="[low, high]: the branching step is drawn uniformly from low .. high - 1; null = [0, steps - 1] "
        "(every step but the last, as the reference; [0, 1] when steps is 1)",
    )
    noise_weight: bool = param(True, help="weight the step's policy loss by its normalised noise level (the paper)")
    share_noise: bool = param(True, help="the G samples of a prompt share the noise and the ODE prefix (the paper)")
    kl_steps: str = kl_steps_param()
    schedule: dict | None = schedule_param()
    final: str | None = final_param()
    kernel: Any = component("kernel", default="sde", help="the stochastic kernel of the branching step")

    nothing_to_train: ClassVar[str] = "the kernel has std 0 at the branching step {branch_step} of {sigmas}"

    @classmethod
    def check_keys(cls, keys: Mapping[str, Any], prefix: str = "sampler") -> list[ConfigError]:
        return super().check_keys(keys, prefix) + step_range_errors(keys, prefix, "branch_range")

    @property
    def bounds(self) -> tuple[int, int]:
        """[low, high): the branching step's candidates."""
        return drawn_range(self.branch_range, (0, max(self.steps - 1, 1)))

    def program(self, sigmas: torch.Tensor, generator: torch.Generator | None) -> Plan:
        low, high = self.bounds
        k = randint(low, high, generator)
        steps = [
            Step(self.kernel, sigmas, i, "branch")
            if i == k
            else Step(EULER, sigmas, i, "prefix" if i < k else "suffix")
            for i in range(self.steps)
        ]
        return Plan(
            steps, prefix=k if self.share_noise else 0, phases=("prefix", "branch", "suffix"), info={"branch_step": k}
        )

    def rollout(
        self,
        policy: Policy,
        prompts: Sequence[str],
        group_size: int,
        *,
        generator: torch.Generator | None = None,
    ) -> Trajectory:
        traj = super().rollout(policy, prompts, group_size, generator=generator)
        k = int(traj.info["branch_step"])
        w = float(noise_weights(self.kernel_stds(traj.sigmas), *self.bounds)[k]) if self.noise_weight else 1.0
        traj.info["branch_weight"] = w
        base = traj.policy_weight
        if base is None:
            base = torch.ones(traj.step_index.shape, dtype=torch.float32, device=traj.step_index.device)
        traj.policy_weight = base * torch.where(traj.step_index == k, w, 1.0).to(base)
        return traj
