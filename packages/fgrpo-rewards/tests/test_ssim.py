"""image-similarity's ``backbone: ssim``: SSIM against closed forms and a window-by-window second
implementation written from Wang et al. 2004's definitions (no model, no transformers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fgrpo.core import media, registry
from fgrpo.core.media import Prompt
from fgrpo.core.testing import RewardConformance, SyntheticImage
from fgrpo.rewards.similarity import ssim

C1, C2 = 0.01**2, 0.03**2
PROMPTS = [Prompt(f"edit {i}", images=(SyntheticImage(i, 16, 16),)) for i in range(3)]


def images(seed: int, shape=(3, 3, 16, 16)) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def naive_ssim(x: np.ndarray, y: np.ndarray) -> float:
    """Mean over channels and every window position that fits of
    (2 mu_x mu_y + C1)(2 s_xy + C2) / ((mu_x² + mu_y² + C1)(s_x² + s_y² + C2)), Gaussian weights
    w_ij ∝ exp(-(i² + j²) / (2 · 1.5²)) over an n x n window, n = min(11, H, W)."""
    c, h, w = x.shape
    n = min(11, h, w)
    offsets = np.arange(n) - (n - 1) / 2
    weights = np.exp(-(offsets[:, None] ** 2 + offsets[None, :] ** 2) / (2 * 1.5**2))
    weights /= weights.sum()
    values = []
    for ch in range(c):
        for i in range(h - n + 1):
            for j in range(w - n + 1):
                a, b = x[ch, i : i + n, j : j + n], y[ch, i : i + n, j : j + n]
                ma, mb = (weights * a).sum(), (weights * b).sum()
                va, vb = (weights * (a - ma) ** 2).sum(), (weights * (b - mb) ** 2).sum()
                cab = (weights * (a - ma) * (b - mb)).sum()
                values.append((2 * ma * mb + C1) * (2 * cab + C2) / ((ma**2 + mb**2 + C1) * (va + vb + C2)))
    return float(np.mean(values))


@pytest.mark.parametrize("shape", [(3, 3, 16, 16), (2, 3, 24, 24), (2, 1, 8, 12)])
def test_ssim_matches_the_window_by_window_definition(shape):
    x, y = images(0, shape), images(1, shape)
    y = 0.6 * x + 0.4 * y  # correlated, so every term of the index matters
    got = ssim(x, y)
    for b in range(shape[0]):
        assert got[b].item() == pytest.approx(naive_ssim(x[b].numpy(), y[b].numpy()), abs=1e-12)


def test_ssim_of_an_image_with_itself_is_one_and_the_index_is_symmetric():
    x, y = images(2), images(3)
    assert torch.allclose(ssim(x, x), torch.ones(3, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(ssim(x, y), ssim(y, x))
    assert (ssim(x, y) < 0.2).all()  # independent noise images share almost no structure


def test_ssim_of_two_flat_images_is_the_luminance_term():
    """Zero variances: SSIM = (2ab + C1) / (a² + b² + C1) exactly."""
    a, b = 0.25, 0.75
    x, y = torch.full((1, 3, 12, 12), a, dtype=torch.float64), torch.full((1, 3, 12, 12), b, dtype=torch.float64)
    assert ssim(x, y).item() == pytest.approx((2 * a * b + C1) / (a * a + b * b + C1), abs=1e-12)
    assert math.isclose(ssim(x, x).item(), 1.0, abs_tol=1e-12)


class TestSSIMSimilarity(RewardConformance):
    reward_name = "image-similarity"

    @pytest.fixture
    def reward(self):
        return registry.create("reward", "image-similarity", backbone="ssim")

    def make_inputs(self):
        return images(4).float(), list(PROMPTS), [{} for _ in PROMPTS]


def test_ssim_reward_compares_each_output_with_its_source_and_loads_nothing():
    reward = registry.create("reward", "image-similarity", backbone="ssim")
    assert reward._features is None
    outputs = images(5).float()
    sources = media.reward_sources(PROMPTS, outputs)
    result = reward(outputs, PROMPTS, [{}] * 3, sources=sources)
    expected = ssim(outputs, torch.stack([s[0] for s in sources]).to(outputs.dtype)).float()
    assert torch.equal(result.scores, expected)
    assert torch.equal(result.details["similarity"], expected)
    copied = reward(torch.stack([s[0] for s in sources]), PROMPTS, [{}] * 3, sources=sources)
    assert torch.allclose(copied.scores, torch.ones(3), atol=1e-6)
