"""clip-score through its real loading code, on a tiny random CLIP saved to a temporary folder."""

from __future__ import annotations

import sys

import pytest
import torch
from PIL import Image

from fgrpo.core import registry
from fgrpo.core.testing import RewardConformance

transformers = pytest.importorskip("transformers")

PROMPTS = ["a red square", "a blue circle", "a green triangle", "the word GRPO"]


@pytest.fixture(scope="module")
def clip_reward(clip_folder, offline):
    return registry.create("reward", "clip-score", path=str(clip_folder), device="cpu")


def images(size: int = 32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (4, 3, size, size), generator=gen).float() / 255  # exact uint8 values


class TestCLIPScore(RewardConformance):
    reward_name = "clip-score"

    @pytest.fixture
    def reward(self, clip_reward):
        return clip_reward

    def make_inputs(self):
        return images(), list(PROMPTS), [{} for _ in PROMPTS]


def test_scores_are_clips_logits_over_the_divisor(clip_folder, offline):
    """Against transformers' own processor (PIL path) and forward pass: diag(logits) / divisor."""
    from transformers import CLIPModel, CLIPProcessor

    reward = registry.create("reward", "clip-score", path=str(clip_folder), device="cpu", divisor=30.0, batch_size=3)
    model = CLIPModel.from_pretrained(clip_folder).eval()
    processor = CLIPProcessor.from_pretrained(clip_folder)
    batch = images()
    pil = [Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()) for img in batch]
    inputs = processor(
        text=PROMPTS, images=pil, padding="max_length", truncation=True, max_length=77, return_tensors="pt"
    )
    with torch.no_grad():
        logits = model(**inputs).logits_per_image.diagonal()
    result = reward(batch, PROMPTS, [{}] * 4)
    torch.testing.assert_close(result.scores, logits / 30.0, atol=1e-4, rtol=1e-4)
    scale = model.logit_scale.exp().item()
    torch.testing.assert_close(result.details["cosine"] * scale / 30.0, result.scores)
    assert (result.details["cosine"].abs() <= 1 + 1e-6).all()


def test_larger_images_are_resized_and_cropped(clip_reward):
    from fgrpo.rewards.clip import preprocess

    config = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
    assert preprocess(torch.rand(2, 3, 48, 96), config).shape == (2, 3, 32, 32)
    assert preprocess(torch.rand(2, 3, 96, 40), config).shape == (2, 3, 32, 32)
    scores = clip_reward(torch.rand(2, 3, 64, 64), PROMPTS[:2], [{}, {}]).scores
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_bad_path_names_the_key(tmp_path, offline):
    with pytest.raises(registry.ComponentError, match="reward.path"):
        registry.create("reward", "clip-score", path=str(tmp_path / "missing"), device="cpu")


def test_missing_extra_names_the_install_command(monkeypatch):
    from fgrpo.rewards.clip import CLIPScore

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError) as info:
        CLIPScore(path="unused")
    assert str(info.value) == 'pip install "fgrpo-rewards[clip]"'


# --- pickscore ---------------------------------------------------------------------------------


class TestPickScore(RewardConformance):
    reward_name = "pickscore"

    @pytest.fixture
    def reward(self, clip_folder, offline):
        return registry.create("reward", "pickscore", path=str(clip_folder), processor_path=None, device="cpu")

    def make_inputs(self):
        return images(), list(PROMPTS), [{} for _ in PROMPTS]


def reference_embeddings(folder, batch, prompts):
    """Unit-norm image and text embeddings the way flow_grpo computes them: transformers' own
    processor on PIL images, get_image_features / get_text_features, then L2 normalisation."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(folder).eval()
    processor = CLIPProcessor.from_pretrained(folder)
    pil = [Image.fromarray((img.permute(1, 2, 0) * 255).round().byte().numpy()) for img in batch]
    with torch.no_grad():
        pixels = processor(images=pil, return_tensors="pt")["pixel_values"]
        text = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        image = model.get_image_features(pixel_values=pixels)
        words = model.get_text_features(**text)
    image = image if isinstance(image, torch.Tensor) else image.pooler_output
    words = words if isinstance(words, torch.Tensor) else words.pooler_output
    return model, image / image.norm(dim=-1, keepdim=True), words / words.norm(dim=-1, keepdim=True)


def test_pickscore_is_flow_grpos_formula(clip_folder, offline):
    """score = exp(logit_scale) x (text . image) / 26, by hand."""
    reward = registry.create("reward", "pickscore", path=str(clip_folder), processor_path=None, device="cpu")
    model, image, words = reference_embeddings(clip_folder, images(), PROMPTS)
    expected = model.logit_scale.exp() * (words @ image.T).diagonal() / 26
    result = reward(images(), PROMPTS, [{}] * 4)
    torch.testing.assert_close(result.scores, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.details["cosine"], (words * image).sum(-1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["clip-score", "pickscore"])
def test_batch_equals_one_by_one(clip_folder, offline, name):
    reward = registry.create("reward", name, path=str(clip_folder), processor_path=None, device="cpu", batch_size=4)
    batch = images()
    together = reward(batch, PROMPTS, [{}] * 4).scores
    alone = torch.cat([reward(batch[i : i + 1], PROMPTS[i : i + 1], [{}]).scores for i in range(4)])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-5)


def test_models_load_once_per_process(clip_folder, offline):
    """Two rewards on the same weights (train and evaluation, or clip-score beside pickscore) share
    one model; another dtype is another copy."""
    a = registry.create("reward", "clip-score", path=str(clip_folder), device="cpu")
    b = registry.create("reward", "pickscore", path=str(clip_folder), processor_path=None, device="cpu")
    c = registry.create("reward", "clip-score", path=str(clip_folder), device="cpu", dtype="bfloat16")
    assert a.model is b.model
    assert c.model is not a.model and next(c.model.parameters()).dtype == torch.bfloat16
    scores = c(images(), PROMPTS, [{}] * 4).scores
    assert scores.dtype == torch.float32 and torch.isfinite(scores).all()


# --- aesthetic ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aesthetic_head(tmp_path_factory):
    """A random head saved as the published file is: a torch state dict with layers.N keys."""
    from fgrpo.rewards.aesthetic import aesthetic_head as make_head

    torch.manual_seed(1)
    head = make_head(16)
    for p in head.parameters():  # larger weights than the default init: visible differences
        torch.nn.init.normal_(p, std=0.5)
    path = tmp_path_factory.mktemp("aesthetic") / "head.pth"
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, path)
    return path


class TestAesthetic(RewardConformance):
    reward_name = "aesthetic"

    @pytest.fixture
    def reward(self, clip_folder, aesthetic_head, offline):
        return registry.create("reward", "aesthetic", head=str(aesthetic_head), path=str(clip_folder), device="cpu")

    def make_inputs(self):
        return images(), list(PROMPTS), [{} for _ in PROMPTS]


def test_aesthetic_head_by_hand(clip_folder, aesthetic_head, offline):
    """The five linear layers without activations on the unit-norm image embedding, by hand."""
    reward = registry.create(
        "reward", "aesthetic", head=str(aesthetic_head), path=str(clip_folder), device="cpu", batch_size=3
    )
    _, image, _ = reference_embeddings(clip_folder, images(), PROMPTS)
    state = torch.load(aesthetic_head, weights_only=True)
    x = image
    for i in (0, 2, 4, 6, 7):
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(reward(images(), PROMPTS, [{}] * 4).scores, x.squeeze(-1), atol=1e-5, rtol=1e-5)
    alone = torch.cat([reward(images()[i : i + 1], PROMPTS[i : i + 1], [{}]).scores for i in range(4)])
    torch.testing.assert_close(alone, x.squeeze(-1), atol=1e-5, rtol=1e-5)


def test_aesthetic_head_errors_name_the_key(clip_folder, tmp_path, offline):
    from fgrpo.rewards.aesthetic import aesthetic_head as make_head

    with pytest.raises(registry.ComponentError, match="reward.head"):
        registry.create("reward", "aesthetic", head=str(tmp_path / "missing.pth"), path=str(clip_folder), device="cpu")
    wrong = tmp_path / "wide.pth"
    torch.save({f"layers.{k}": v for k, v in make_head(768).state_dict().items()}, wrong)
    with pytest.raises(registry.ComponentError, match=r"reward.head: the head reads 768-d"):
        registry.create("reward", "aesthetic", head=str(wrong), path=str(clip_folder), device="cpu")
    junk = tmp_path / "junk.pth"
    torch.save({"weight": torch.zeros(2)}, junk)
    with pytest.raises(registry.ComponentError, match="not an aesthetic head"):
        registry.create("reward", "aesthetic", head=str(junk), path=str(clip_folder), device="cpu")
