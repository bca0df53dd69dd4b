"""OCR reward (flow_grpo's): does the image show the text the prompt asks for?

Needs the ``[ocr]`` extra (``rapidocr`` + ``onnxruntime``; the PP-OCR models ship inside the
rapidocr wheel, nothing is downloaded). Both are imported only when the reward is built.

Speed: the detector reads images at most ``det_side`` pixels on their longer side (960, as
flow_grpo's PaddleOCR does; rapidocr's own default upscales a 512-pixel image to 736 on its
shorter side, twice the pixels); the recogniser reads the text lines of ``batch_size`` images in
one call. ``det_batch`` > 1 stacks images into one detector call: faster on a GPU execution
provider, slower on a CPU (memory-bound; ``tools/bench/ocr.py`` measures both).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from PIL import Image

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.core.visuals import to_uint8

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
    detect: bool = param(
        True, help="detect text boxes first; false = recognise the whole image as one line (much faster)"
    )
    min_confidence: float = param(
        0.0, ge=0.0, le=1.0, help="drop recognised lines below this confidence (flow_grpo: 0)"
    )
    frame_interval: int = param(4, ge=1, help="for videos: score every n-th frame")
    batch_size: int = param(16, ge=1, help="images whose text lines go through the recogniser together")
    det_side: int = param(
        960, ge=32, help="the detector reads images at most this many pixels on their longer side (PaddleOCR: 960)"
    )
    det_batch: int = param(1, ge=1, help="images stacked per detector call (>1 pays off on a GPU, not on a CPU)")
    threads: int = param(0, ge=0, help="onnxruntime threads per call; 0 = onnxruntime's default (all cores)")
    _engine: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        _require_extra()
        try:
            from rapidocr import RapidOCR
        except ImportError as exc:
            raise ImportError(INSTALL) from exc
        params = {
            "Global.log_level": "error",
            "Global.use_cls": False,
            "Global.text_score": self.min_confidence,
            "Rec.rec_batch_num": max(6, self.batch_size),
            "Det.limit_type": "max",
            "Det.limit_side_len": self.det_side,
        }
        if self.threads:
            params["EngineConfig.onnxruntime.intra_op_num_threads"] = self.threads
            params["EngineConfig.onnxruntime.inter_op_num_threads"] = 1
        self._engine = RapidOCR(params=params)

    def read(self, image: Image.Image) -> str:
        """The text the OCR engine reads in one RGB PIL image ('' when it finds none), through
        rapidocr's own single-image pipeline (the reference the batched path is tested against)."""
        if self._engine is None:  # pragma: no cover - only if __attrs_post_init__ was bypassed
            raise ImportError(INSTALL)
        result = (
            self._engine(image, use_cls=False) if self.detect else self._engine(image, use_det=False, use_cls=False)
        )
        texts, scores = result.txts or (), result.scores or ()
        return "".join(t for t, s in zip(texts, scores, strict=False) if s >= self.min_confidence)

    def read_batch(self, arrays: Sequence[np.ndarray]) -> list[str]:
        """The text read in each (H, W, 3) uint8 RGB image: rapidocr's steps (load, resize within
        bounds, vertical padding, detect, sort and crop the boxes, recognise), with the detector
        run on stacked images and the recogniser on all their lines at once."""
        engine = self._engine
        prepared = [engine.preprocess_img(engine.load_img(Image.fromarray(a)))[0] for a in arrays]
        lines = self._detect_lines(prepared) if self.detect else [[img] for img in prepared]
        flat = [crop for crops in lines for crop in crops]
        texts: Sequence[str] = ()
        scores: Sequence[float] = ()
        if flat:
            rec = engine._load_rec_model()
            from rapidocr.ch_ppocr_rec import TextRecInput

            out = rec(TextRecInput(img=flat, return_word_box=False))
            texts, scores = out.txts or (), out.scores or ()
        read, k = [], 0
        for crops in lines:
            pairs = list(zip(texts[k : k + len(crops)], scores[k : k + len(crops)], strict=False))
            k += len(crops)
            read.append("".join(t for t, s in pairs if t.strip() and s >= self.min_confidence))
        return read

    def _detect_lines(self, images: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
        from rapidocr.utils.process_img import apply_vertical_padding

        engine = self._engine
        det = engine._load_det_model()
        if engine.cfg.Global.use_vertical_padding:
            images = [
                apply_vertical_padding(img, {}, engine.width_height_ratio, engine.min_height)[0] for img in images
            ]
        pre = det.get_preprocess()
        inputs = [pre(img) for img in images]
        preds: list[Any] = [None] * len(images)
        by_shape: dict[tuple, list[int]] = {}
        for i, x in enumerate(inputs):
            if x is not None:
                by_shape.setdefault(x.shape, []).append(i)
        for same_size in by_shape.values():
            for start in range(0, len(same_size), self.det_batch):
                members = same_size[start : start + self.det_batch]
                out = det.session(np.concatenate([inputs[i] for i in members]))
                for row, i in enumerate(members):
                    preds[i] = out[row : row + 1]
        lines = []
        for img, pred in zip(images, preds, strict=True):
            boxes = det.postprocess_op(pred, img.shape[:2])[0] if pred is not None else []
            lines.append(engine.crop_text_regions(img, det.sorted_boxes(boxes)) if len(boxes) else [])
        return lines

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        if not isinstance(outputs, torch.Tensor) or outputs.dim() not in (4, 5):
            raise ValueError("ocr reward expects images (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1]")
        metas: Sequence[Mapping[str, Any] | None] = metadata if metadata else [None] * len(prompts)
        wanted = [text_to_render(p, m) for p, m in zip(prompts, metas, strict=True)]
        video = outputs.dim() == 5
        frames = [outputs[b, :: self.frame_interval] if video else outputs[b : b + 1] for b in range(outputs.shape[0])]
        arrays = [array for f in frames for array in to_uint8(f)]
        texts: list[str] = []
        for start in range(0, len(arrays), self.batch_size):
            chunk = arrays[start : start + self.batch_size]
            try:
                texts += self.read_batch(chunk)
            except Exception as exc:  # flow_grpo: a failed OCR call is the maximum penalty
                log.warning("OCR failed on samples %d-%d: %s", start, start + len(chunk) - 1, exc)
                texts += [""] * len(chunk)
        scores, distances, recognised = [], [], []
        k = 0
        for b, f in enumerate(frames):
            frame_texts = texts[k : k + f.shape[0]]
            k += f.shape[0]
            frame_scores, frame_distances = zip(*(ocr_score(t, wanted[b]) for t in frame_texts), strict=True)
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
