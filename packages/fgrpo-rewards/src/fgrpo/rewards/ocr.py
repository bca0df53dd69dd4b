"""OCR reward (flow_grpo's): does the image show the text the prompt asks for?

Needs the ``[ocr]`` extra (``rapidocr`` + ``onnxruntime``; the PP-OCR models ship inside the
rapidocr wheel, nothing is downloaded). Both are imported only when the reward is built.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from PIL import Image

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.rewards.jpeg import to_uint8_images

INSTALL = 'pip install "fgrpo-rewards[ocr]"'

log = logging.getLogger(__name__)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def normalise(text: str) -> str:
    """flow_grpo compares texts without spaces, in lower case."""
    return text.replace(" ", "").lower()


def ocr_score(recognised: str, wanted: str) -> tuple[float, int]:
    """(1 - d / len(wanted), d) on normalised texts, as flow_grpo scores OCR.

    d = 0 when the wanted text appears anywhere in the recognised text, else their edit
    distance, capped at len(wanted) (so the score is in [0, 1]). An empty wanted text scores 1
    when nothing was recognised, else 0.
    """
    got, want = normalise(recognised), normalise(wanted)
    if not want:
        return (1.0, 0) if not got else (0.0, len(got))
    distance = 0 if want in got else min(edit_distance(got, want), len(want))
    return 1.0 - distance / len(want), distance


def text_to_render(prompt: str, metadata: Mapping[str, Any] | None = None) -> str:
    """``metadata["text"]`` if given, else the first double-quoted span of the prompt."""
    if metadata is not None and metadata.get("text") is not None:
        return str(metadata["text"])
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(
            f"ocr reward: prompt {prompt!r} has no text in double quotes (e.g. 'a sign that says "
            f"\"OPEN\"') and its metadata has no 'text'"
        )
    return parts[1]


def _require_extra() -> None:
    if importlib.util.find_spec("rapidocr") is None or importlib.util.find_spec("onnxruntime") is None:
        raise ImportError(INSTALL)


@attrs.define
class OCRReward:
    """1 - normalised edit distance between the text to render and the text read in the image.

    The text to render is ``metadata["text"]`` or the first double-quoted span of the prompt;
    both texts are compared without spaces, in lower case; a recognised text that contains the
    wanted one scores 1 (flow_grpo's rule). Recognised lines are joined in reading order.
    Videos (B, F, 3, H, W) score every ``frame_interval``-th frame and average the frames that
    score above 0 (0 if none does), as flow_grpo's video OCR does. Details: ``recognised``
    (the texts read), ``edit_distance``.
    """

    accepts_video = True  # whole videos, not frames: flow_grpo's video rule needs all frames of a sample
    detect: bool = param(True, help="detect text boxes first; false = recognise the whole image as one line (much faster)")
    min_confidence: float = param(0.0, ge=0.0, le=1.0, help="drop recognised lines below this confidence (flow_grpo: 0)")
    frame_interval: int = param(4, ge=1, help="for videos: score every n-th frame")
    _engine: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        _require_extra()
        try:
            from rapidocr import RapidOCR
        except ImportError as exc:
            raise ImportError(INSTALL) from exc
        self._engine = RapidOCR(
            params={"Global.log_level": "error", "Global.use_cls": False, "Global.text_score": self.min_confidence}
        )

    def read(self, image: Image.Image) -> str:
        """The text the OCR engine reads in one RGB PIL image ('' when it finds none)."""
        if self._engine is None:  # pragma: no cover - only if __attrs_post_init__ was bypassed
            raise ImportError(INSTALL)
        if self.detect:
            result = self._engine(image, use_cls=False)
            texts = result.txts or ()
            scores = result.scores or ()
        else:
            result = self._engine(image, use_det=False, use_cls=False)
            texts, scores = result.txts or (), result.scores or ()
        return "".join(t for t, s in zip(texts, scores) if s >= self.min_confidence)

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        if not isinstance(outputs, torch.Tensor) or outputs.dim() not in (4, 5):
            raise ValueError("ocr reward expects images (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1]")
        metas: Sequence[Mapping[str, Any] | None] = metadata if metadata else [None] * len(prompts)
        wanted = [text_to_render(p, m) for p, m in zip(prompts, metas)]
        video = outputs.dim() == 5
        scores, distances, recognised = [], [], []
        for b in range(outputs.shape[0]):
            frames = outputs[b, :: self.frame_interval] if video else outputs[b : b + 1]
            frame_scores, frame_texts, frame_distances = [], [], []
            for array in to_uint8_images(frames):
                try:
                    text = self.read(Image.fromarray(array))
                except Exception as exc:  # flow_grpo: a failed OCR call is the maximum penalty
                    log.warning("OCR failed on sample %d: %s", b, exc)
                    text = ""
                score, distance = ocr_score(text, wanted[b])
                frame_scores.append(score)
                frame_texts.append(text)
                frame_distances.append(distance)
            if video:
                positive = [s for s in frame_scores if s > 0]
                scores.append(sum(positive) / len(positive) if positive else 0.0)
                recognised.append(" | ".join(frame_texts))
                distances.append(sum(frame_distances) / len(frame_distances))
            else:
                scores.append(frame_scores[0])
                recognised.append(frame_texts[0])
                distances.append(frame_distances[0])
        return RewardResult(
            scores=torch.tensor(scores, dtype=torch.float32),
            details={"recognised": recognised, "edit_distance": torch.tensor(distances, dtype=torch.float32)},
        )
