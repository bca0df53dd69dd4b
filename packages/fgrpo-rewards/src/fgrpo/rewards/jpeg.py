"""JPEG (in)compressibility: the size of each image saved as a JPEG, as flow_grpo scores it."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch
from PIL import Image

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.core.visuals import is_image_batch, to_uint8


def jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """(B,) float32: the size in kB (1000 bytes) of each image written as a JPEG at ``quality``.

    Videos (B, F, 3, H, W) score the mean size of their frames.
    """
    if isinstance(images, torch.Tensor) and images.dim() == 5:
        b, f = images.shape[:2]
        return jpeg_sizes_kb(images.reshape(b * f, *images.shape[2:]), quality).view(b, f).mean(dim=1)
    if not is_image_batch(images):
        to_uint8(images)  # raises its one-line error, naming the whole batch's shape
    sizes = []
    for image in images:  # one at a time: converting the whole batch took twice its size again in float copies
        buffer = io.BytesIO()
        Image.fromarray(to_uint8(image[None])[0]).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class _JpegSize:
    """score = sign x scale x the image's size in kB as a JPEG at ``quality``; details ``jpeg_kb``."""

    __slots__ = ()
    sign: ClassVar[float]
    quality: int
    scale: float

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        kb = jpeg_sizes_kb(outputs, self.quality)
        return RewardResult(scores=self.sign * self.scale * kb, details={"jpeg_kb": kb})


@attrs.define
class JpegCompressibility(_JpegSize):
    """Smaller JPEG files score higher: score = -scale x size in kB (quality 95 by default).

    flow_grpo's ``jpeg_compressibility`` is this with ``scale: 0.002`` (it divides by 500); the
    scale does not change GRPO's per-group advantages, only the weight against other rewards.
    Details: ``jpeg_kb`` (B,).
    """

    sign: ClassVar[float] = -1.0
    quality: int = param(95, ge=1, le=100, help="JPEG quality the size is measured at")
    scale: float = param(1.0, gt=0, help="multiplies the size in kB (flow_grpo: 0.002)")


@attrs.define
class JpegIncompressibility(_JpegSize):
    """Larger JPEG files score higher: score = scale x size in kB (quality 95 by default).

    Equal to flow_grpo's ``jpeg_incompressibility`` with the default scale 1. Details:
    ``jpeg_kb`` (B,).
    """

    sign: ClassVar[float] = 1.0
    quality: int = param(95, ge=1, le=100, help="JPEG quality the size is measured at")
    scale: float = param(1.0, gt=0, help="multiplies the size in kB")
