"""image-similarity through its real loading code, on a tiny random CLIP and DINOv2 saved to
temporary folders: the cosine of the output's and the source's image features."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from fgrpo.core import media, registry
from fgrpo.core.media import Prompt
from fgrpo.core.testing import RewardConformance, SyntheticImage

transformers = pytest.importorskip("transformers")

PROMPTS = [Prompt(f"edit {i}", images=(SyntheticImage(i, 32, 32),)) for i in range(4)]


def outputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (4, 3, 32, 32), generator=gen).float() / 255


@pytest.fixture(scope="module")
def dino_folder(tmp_path_factory):
    from fgrpo.rewards.testing import save_tiny_dinov2

    return save_tiny_dinov2(tmp_path_factory.mktemp("tiny-dino"))


class TestImageSimilarity(RewardConformance):
    reward_name = "image-similarity"

    @pytest.fixture
    def reward(self, clip_folder, offline):
        return registry.create("reward", "image-similarity", path=str(clip_folder), device="cpu")

    def make_inputs(self):
        return outputs(), list(PROMPTS), [{} for _ in PROMPTS]


def test_clip_similarity_is_the_cosine_of_clips_image_embeddings(clip_folder, offline):
    """Against transformers' own processor (PIL path) and CLIPModel.get_image_features."""
    from transformers import CLIPModel, CLIPProcessor

    reward = registry.create("reward", "image-similarity", path=str(clip_folder), device="cpu", batch_size=3)
    model = CLIPModel.from_pretrained(clip_folder).eval()
    processor = CLIPProcessor.from_pretrained(clip_folder)
    batch = outputs()
    sources = media.reward_sources(PROMPTS, batch)

    def embed(images):
        pil = [Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()) for img in images]
        with torch.no_grad():
            out = model.get_image_features(**processor(images=pil, return_tensors="pt"))
        out = out if isinstance(out, torch.Tensor) else out.pooler_output
        return torch.nn.functional.normalize(out, dim=-1)

    expected = (embed(batch) * embed(torch.stack([s[0] for s in sources]))).sum(-1)
    result = reward(batch, PROMPTS, [{}] * 4, sources=sources)
    torch.testing.assert_close(result.scores, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(result.details["similarity"], result.scores)
    same = reward(torch.stack([s[0] for s in sources]), PROMPTS, [{}] * 4, sources=sources).scores
    torch.testing.assert_close(same, torch.ones(4), atol=1e-5, rtol=0)  # an output that is its source


def test_dino_backbone_and_the_source_index(dino_folder, offline):
    reward = registry.create("reward", "image-similarity", backbone="dino", path=str(dino_folder), device="cpu")
    two = [Prompt("p", images=(SyntheticImage(1), SyntheticImage(2)))] * 2
    batch = torch.stack([media.to_tensor(SyntheticImage(2).to_pil()), media.to_tensor(SyntheticImage(1).to_pil())])
    first = reward(batch, two, [{}, {}], sources=media.reward_sources(two, batch)).scores
    assert first[1].item() == pytest.approx(1.0, abs=1e-5) and first[0].item() < 1 - 1e-4
    second = registry.create(
        "reward", "image-similarity", backbone="dino", path=str(dino_folder), device="cpu", source=1
    )
    assert second(batch, two, [{}, {}], sources=media.reward_sources(two, batch)).scores[0].item() == pytest.approx(
        1.0, abs=1e-5
    )
    with pytest.raises(ValueError, match=r"image-similarity: prompt 'plain' has 0 source image\(s\)"):
        reward(batch[:1], ["plain"], [{}], sources=[()])


def test_bilinear_resize_is_flow_grpos(clip_folder, offline):
    from fgrpo.rewards.clip import preprocess

    config = {"size": {"shortest_edge": 16}, "crop_size": {"height": 16, "width": 16}, "do_normalize": False}
    x = torch.rand(1, 3, 48, 48)
    torch.testing.assert_close(
        preprocess(x, config, mode="bilinear"),
        torch.nn.functional.interpolate(x, size=(16, 16), mode="bilinear", antialias=True, align_corners=False).clamp(
            0, 1
        ),
    )
    a = registry.create("reward", "image-similarity", path=str(clip_folder), device="cpu", resize="bilinear")
    big = torch.rand(2, 3, 64, 64)
    prompts = PROMPTS[:2]
    assert a(big, prompts, [{}, {}], sources=media.reward_sources(prompts, big)).scores.shape == (2,)
