"""An example third-party reward: how bright an image is, or how close to a target brightness."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult


@attrs.define
class Brightness:
    """Mean pixel value of (B, 3, H, W) images in [0, 1]; with ``target`` set, -|mean - target|."""

    target: float | None = param(None, ge=0.0, le=1.0, help="brightness to aim at; none = brighter is better")

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        mean = outputs.float().flatten(1).mean(dim=1)
        scores = mean if self.target is None else -(mean - self.target).abs()
        return RewardResult(scores=scores, details={"brightness": mean})
