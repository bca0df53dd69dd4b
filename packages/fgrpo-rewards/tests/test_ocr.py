"""OCR reward: the edit-distance scoring by hand always; the real engine when [ocr] is installed."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from fgrpo.core.testing import RewardConformance
from fgrpo.rewards.ocr import INSTALL, OCRReward, edit_distance, ocr_score, text_to_render


@pytest.mark.parametrize(
    ("a", "b", "d"),
    [
        ("", "", 0),
        ("abc", "", 3),
        ("", "abc", 3),
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("grpo", "grpo", 0),
        ("abc", "cba", 2),
        ("intention", "execution", 5),
    ],
)
def test_edit_distance(a, b, d):
    assert edit_distance(a, b) == d == edit_distance(b, a)


def test_ocr_score_follows_flow_grpo():
    assert ocr_score("Hello World", "hello world") == (1.0, 0)  # spaces and case are ignored
    assert ocr_score("SALE: hello world!", "Hello World") == (1.0, 0)  # containment scores 1
    assert ocr_score("helo", "hello") == (0.8, 1)
    assert ocr_score("", "cat") == (0.0, 3)
    assert ocr_score("a very long unrelated line", "cat") == (0.0, 3)  # capped at len(wanted)
    assert ocr_score("", "") == (1.0, 0) and ocr_score("x", " ") == (0.0, 1)


def test_text_to_render():
    assert text_to_render('a sign that says "Open Late" in neon') == "Open Late"
    assert text_to_render('a sign "A" and "B"') == "A"
    assert text_to_render("anything", {"text": "GRPO"}) == "GRPO"
    with pytest.raises(ValueError, match="no text in double quotes"):
        text_to_render("a sign without quotes")


@pytest.mark.parametrize("module", ["rapidocr", "onnxruntime"])
def test_missing_extra_names_the_install_command(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(ImportError) as info:
        OCRReward()
    assert str(info.value) == INSTALL == 'pip install "fgrpo-rewards[ocr]"'


def render(text: str, width: int = 256, height: int = 96) -> torch.Tensor:
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((10, 20), text, fill="black", font=ImageFont.load_default(size=48))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


PROMPTS = ['a sign that says "GRPO"', 'a poster reading "hello"', 'a blank wall with "cat"', 'a logo "flaw"']


class TestOCRReward(RewardConformance):
    """Recognition only (detect: false, ~30 ms an image) keeps the suite fast."""

    reward_name = "ocr"
    reward_params = {"detect": False}

    @pytest.fixture(autouse=True)
    def _needs_the_extra(self):
        pytest.importorskip("rapidocr")
        pytest.importorskip("onnxruntime")

    def make_inputs(self):
        images = torch.stack([render("GRPO"), render("hello"), torch.ones(3, 96, 256), render("Flow")])
        return images, list(PROMPTS), [{} for _ in PROMPTS]

    def test_reads_rendered_text(self, reward):
        images, prompts, metadata = self.make_inputs()
        result = reward(images, prompts, metadata)
        torch.testing.assert_close(result.scores, torch.tensor([1.0, 1.0, 0.0, 0.75]))
        assert [t.lower() for t in result.details["recognised"]] == ["grpo", "hello", "", "flow"]

    def test_metadata_text_overrides_the_prompt(self, reward):
        images, prompts, _ = self.make_inputs()
        result = reward(images[:1], prompts[:1], [{"text": "GRPQ"}])
        assert result.scores.item() == 0.75


def test_detection_path_reads_text():
    pytest.importorskip("rapidocr")
    pytest.importorskip("onnxruntime")
    from fgrpo.core import registry

    reward = registry.create("reward", "ocr")
    result = reward(render("GRPO")[None], ['a sign "grpo"'], [{}])
    assert result.scores.item() == 1.0


@pytest.mark.parametrize("detect", [True, False])
def test_batched_reading_equals_rapidocrs_own_pipeline(detect):
    """read_batch (stacked detection, one recogniser call for every line) reads what rapidocr's
    single-image call reads, image by image; the reward's scores do not depend on the batch size."""
    pytest.importorskip("rapidocr")
    pytest.importorskip("onnxruntime")
    from fgrpo.core import registry
    from fgrpo.core.visuals import to_uint8

    reward = registry.create("reward", "ocr", detect=detect, batch_size=8)
    batch = torch.stack([render(t) for t in ("GRPO", "hello", "Flow 2025", "cat")] + [torch.ones(3, 96, 256)])
    arrays = list(to_uint8(batch))
    alone = [reward.read(Image.fromarray(a)) for a in arrays]
    assert reward.read_batch(arrays) == alone
    assert [t.lower().replace(" ", "") for t in alone[:4]] == ["grpo", "hello", "flow2025", "cat"] and alone[4] == ""
    prompts = ['"GRPO"', '"hello"', '"Flow 2025"', '"cat"', '"x"']
    one_by_one = registry.create("reward", "ocr", detect=detect, batch_size=1)(batch, prompts, [{}] * 5)
    together = reward(batch, prompts, [{}] * 5)
    torch.testing.assert_close(together.scores, one_by_one.scores)
    assert together.details["recognised"] == one_by_one.details["recognised"]


def test_videos_average_the_frames_that_read_something():
    """flow_grpo's video rule: every frame_interval-th frame, the mean of the frames scoring > 0."""
    pytest.importorskip("rapidocr")
    pytest.importorskip("onnxruntime")
    from fgrpo.core import registry

    reward = registry.create("reward", "ocr", detect=False, frame_interval=2)
    blank = torch.ones(3, 96, 256)
    video = torch.stack([render("GRPO"), blank, blank, blank, render("GRPQ"), blank])  # frames 0, 2, 4 scored
    result = reward(torch.stack([video, torch.stack([blank] * 6)]), ['"GRPO"', '"GRPO"'], [{}, {}])
    torch.testing.assert_close(result.scores, torch.tensor([(1.0 + 0.75) / 2, 0.0]))
    assert result.details["recognised"][0].lower().split(" | ") == ["grpo", "", "grpq"]
