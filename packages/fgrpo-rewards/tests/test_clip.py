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


def byte_characters() -> list[str]:
    """The 256 characters of GPT-2's byte-level alphabet (CLIP's BPE uses the same)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """A random 2-layer CLIP (hidden 32, 32x32 images), its byte-level tokenizer and processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    chars = byte_characters()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    text = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77, projection_dim=16,
                bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                pad_token_id=vocab["<|endoftext|>"])
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  image_size=32, patch_size=8, projection_dim=16)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    folder = tmp_path_factory.mktemp("tiny-clip")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def offline():
    import huggingface_hub.constants as hub

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(hub, "HF_HUB_OFFLINE", True)
        yield


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
    inputs = processor(text=PROMPTS, images=pil, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
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
