"""JPEG (in)compressibility: conformance, and the sizes by hand."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from fgrpo.core import registry
from fgrpo.core.testing import RewardConformance


def images() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    flat = torch.full((1, 3, 32, 32), 0.5)
    noisy = torch.rand(1, 3, 32, 32, generator=gen)
    gradient = torch.linspace(0, 1, 32).view(1, 1, 1, 32).expand(1, 3, 32, 32)
    half = torch.rand(1, 3, 32, 32, generator=gen) * 0.3
    return torch.cat([flat, noisy, gradient, half])


class TestJpegCompressibility(RewardConformance):
    reward_name = "jpeg-compressibility"

    def make_inputs(self):
        return images(), ["a", "b", "c", "d"], [{}, {}, {}, {}]


class TestJpegIncompressibility(TestJpegCompressibility):
    reward_name = "jpeg-incompressibility"
    reward_params = {"quality": 80}


def size_kb(array: np.ndarray, quality: int = 95) -> float:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


def test_sizes_match_pil_by_hand():
    batch = images()
    expected = [size_kb((img.permute(1, 2, 0) * 255).round().clamp(0, 255).byte().numpy()) for img in batch]
    incompressible = registry.create("reward", "jpeg-incompressibility")(batch, list("abcd"), [{}] * 4)
    torch.testing.assert_close(incompressible.scores, torch.tensor(expected))
    torch.testing.assert_close(incompressible.details["jpeg_kb"], torch.tensor(expected))
    compressible = registry.create("reward", "jpeg-compressibility", scale=0.002)(batch, list("abcd"), [{}] * 4)
    torch.testing.assert_close(compressible.scores, -torch.tensor(expected) / 500)


def test_noise_is_less_compressible_than_a_flat_image():
    scores = registry.create("reward", "jpeg-compressibility")(images(), list("abcd"), [{}] * 4).scores
    assert scores[0] > scores[1]


def test_videos_score_the_mean_frame():
    batch = images()
    video = torch.stack([batch[:2], batch[2:]])  # (2, 2, 3, H, W)
    reward = registry.create("reward", "jpeg-incompressibility")
    frames = reward(batch, list("abcd"), [{}] * 4).scores
    torch.testing.assert_close(reward(video, ["x", "y"], [{}, {}]).scores, frames.view(2, 2).mean(1))


def test_bad_shape_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        registry.create("reward", "jpeg-compressibility")(torch.rand(2, 1, 8, 8), ["a", "b"], [{}, {}])
