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
from fgrpo.rewards.similarity import patch_ssim, spared_ssim, ssim

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


def test_patch_ssim_is_the_ssim_of_each_crop_row_by_row():
    x, y = images(6, (2, 3, 24, 24)), images(7, (2, 3, 24, 24))
    y = 0.7 * x + 0.3 * y
    got = patch_ssim(x, y, 3)
    assert got.shape == (2, 9)
    for r in range(3):
        for c in range(3):
            crop = (..., slice(8 * r, 8 * r + 8), slice(8 * c, 8 * c + 8))
            assert torch.equal(got[:, 3 * r + c], ssim(x[crop], y[crop]))
    uneven = patch_ssim(x[..., :23, :22], y[..., :23, :22], 2)  # edges at round(i * side / grid)
    assert torch.equal(uneven[:, 3], ssim(x[..., 12:23, 11:22], y[..., 12:23, 11:22]))


def test_spared_ssim_sets_the_least_similar_patches_aside():
    x = images(8, (1, 3, 24, 24))
    assert torch.equal(spared_ssim(x, images(9, (1, 3, 24, 24)), 1, 0), ssim(x, images(9, (1, 3, 24, 24))))
    edited = x.clone()
    edited[..., 0:8, 0:8] = 1.0  # the asked-for change: one patch
    assert spared_ssim(x, edited, 3, 1).item() == pytest.approx(1.0, abs=1e-12)
    whole = ssim(x, edited).item()
    assert whole < 0.95  # a whole-image SSIM charges it
    collateral = edited.clone()
    collateral[..., 16:24, 8:16] = 0.5  # and one more patch changed: charged 1/8 of its dissimilarity
    second = ssim(x[..., 16:24, 8:16], collateral[..., 16:24, 8:16]).item()
    first = ssim(x[..., 0:8, 0:8], collateral[..., 0:8, 0:8]).item()
    kept = (7 + max(first, second)) / 8
    assert spared_ssim(x, collateral, 3, 1).item() == pytest.approx(kept, abs=1e-12)
    assert spared_ssim(x, collateral, 3, 2).item() == pytest.approx(1.0, abs=1e-12)


def test_grid_and_spare_are_checked_against_the_backbone_and_the_grid():
    from fgrpo.core.config import check_params
    from fgrpo.rewards.similarity import ImageSimilarity

    _, errors = check_params(ImageSimilarity, {"backbone": "ssim", "grid": 3, "spare": 9}, "reward")
    assert [(e.key, e.message) for e in errors] == [
        ("reward.spare", "got 9; allowed: fewer than the grid's 9 patches")
    ]
    _, errors = check_params(ImageSimilarity, {"backbone": "dino", "grid": 3, "spare": 1}, "reward")
    assert [e.key for e in errors] == ["reward.grid", "reward.spare"]
    assert "unless backbone is ssim" in errors[0].message
    _, errors = check_params(ImageSimilarity, {"backbone": "ssim", "grid": 3, "spare": 8}, "reward")
    assert errors == []


def test_a_grid_finer_than_the_image_is_refused_with_the_sizes():
    with pytest.raises(ValueError, match="grid 9 is finer than the 8x8 images"):
        patch_ssim(images(0, (1, 3, 8, 8)), images(1, (1, 3, 8, 8)), 9)


def test_the_reward_scores_with_the_spared_patches():
    reward = registry.create("reward", "image-similarity", backbone="ssim", grid=2, spare=1)
    sources = media.reward_sources(PROMPTS, images(5).float())
    reference = torch.stack([s[0] for s in sources])
    outputs = reference.clone()
    outputs[:, :, :8, :8] = 0.0  # one of the four patches redrawn: spared
    outputs[2, :, 8:, 8:] = 1.0  # and a second one in the last image: charged
    scores = reward(outputs, PROMPTS, [{}] * 3, sources=sources).scores
    assert torch.allclose(scores[:2], torch.ones(2), atol=1e-6)
    assert torch.equal(scores[2:], spared_ssim(outputs[2:], reference[2:], 2, 1).float())
    assert scores[2] < 0.95
