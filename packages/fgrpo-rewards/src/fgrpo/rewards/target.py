"""A computed reward for vector outputs: how close each sample lands to its prompt's target."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.core.vectors import target_vectors


@attrs.define
class TargetDistance:
    """Distance of each output to the target its prompt names (``fgrpo.core.vectors``).

    Outputs are (B, *shape) tensors, flattened to (B, D); a prompt ``"target 0.5 -1"`` aims at
    (0.5, -1), ``metadata["target"]`` overrides the prompt, and any other prompt has a fixed
    pseudo-random target in [-1, 1]^D. With d = ||x - target||:

    - ``form: distance`` (default): score = -d (unbounded, 0 is perfect);
    - ``form: gaussian``: score = exp(-d^2 / temperature), in (0, 1].

    Details: ``distance`` (B,).
    """

    form: str = param("distance", choices=("distance", "gaussian"), help="-d, or exp(-d^2/temperature)")
    temperature: float = param(1.0, gt=0, help="width of the gaussian form")

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        x = torch.as_tensor(outputs).detach().to(torch.float32)
        if x.shape[0] != len(prompts):
            raise ValueError(f"target-distance got {x.shape[0]} outputs for {len(prompts)} prompts")
        x = x.reshape(x.shape[0], -1)
        targets = target_vectors(list(prompts), x.shape[1], metadata).to(x.device)
        distance = (x - targets).norm(dim=1)
        if self.form == "gaussian":
            scores = torch.exp(-distance.pow(2) / self.temperature)
        else:
            scores = -distance
        return RewardResult(scores=scores, details={"distance": distance})
