"""CLIP score: how well each image matches its prompt, by a CLIP model (a hub id or a local folder).

Needs the ``[clip]`` extra (transformers), imported only when the reward is built. No CLIP weights
ship on PyPI; ``path`` names a hub model (downloaded by transformers on first use, honouring
HF_HUB_OFFLINE / HF_HOME) or a folder written by ``save_pretrained``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult

INSTALL = 'pip install "fgrpo-rewards[clip]"'

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _size(value: Any, what: str) -> tuple[int, int] | int:
    """An image processor's size entry: (height, width), or an int shortest edge."""
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, Mapping):
        if "height" in value and "width" in value:
            return (int(value["height"]), int(value["width"]))
        if "shortest_edge" in value:
            return int(value["shortest_edge"])
    raise ValueError(f"unsupported image processor {what}: {value!r}")


def preprocess(images: torch.Tensor, config: Mapping[str, Any]) -> torch.Tensor:
    """CLIP's resize / centre crop / normalise on (B, 3, H, W) floats in [0, 1], in torch.

    Follows the processor's ``preprocessor_config.json`` (``size``, ``crop_size``,
    ``image_mean``, ``image_std``); bicubic, antialiased resizing like the PIL path.
    """
    x = images.float().clamp(0, 1)
    if config.get("do_resize", True) and config.get("size") is not None:
        size = _size(config["size"], "size")
        if isinstance(size, int):  # shortest edge -> size, aspect ratio kept (as transformers does)
            h, w = x.shape[-2:]
            size = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
        if tuple(x.shape[-2:]) != tuple(size):
            x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)
    if config.get("do_center_crop", True) and config.get("crop_size") is not None:
        ch, cw = _size(config["crop_size"], "crop_size")
        h, w = x.shape[-2:]
        top, left = max((h - ch) // 2, 0), max((w - cw) // 2, 0)
        x = x[..., top : top + ch, left : left + cw]
    if config.get("do_normalize", True):
        mean = torch.tensor(config.get("image_mean", (0.48145466, 0.4578275, 0.40821073)), dtype=x.dtype)
        std = torch.tensor(config.get("image_std", (0.26862954, 0.26130258, 0.27577711)), dtype=x.dtype)
        x = (x - mean.view(1, -1, 1, 1).to(x.device)) / std.view(1, -1, 1, 1).to(x.device)
    return x


@attrs.define
class CLIPScore:
    """score = cos(image embedding, text embedding) x exp(logit_scale) / divisor.

    With the default divisor 100 and OpenAI CLIP (exp(logit_scale) = 100) the score is the
    cosine similarity itself, about 0.2-0.35 for matching pairs. flow_grpo's ``clip_score`` divides
    CLIP's logits by 30: set ``divisor: 30`` to reproduce its scale. Images are preprocessed in
    torch from the float tensors (resize, crop, normalise as the model's processor configures);
    prompts are tokenised with the processor's tokenizer, padded and truncated to the text
    model's length. Details: ``cosine`` (B,).
    """

    path: str = param("openai/clip-vit-large-patch14", help="hub id or local folder of a CLIPModel")
    processor_path: str | None = param(None, help="hub id or folder of its CLIPProcessor; none = path")
    divisor: float = param(100.0, gt=0, help="the logits are divided by this (flow_grpo: 30)")
    batch_size: int = param(32, ge=1, help="images scored per forward pass")
    dtype: str = param("float32", choices=tuple(DTYPES), help="dtype of the CLIP weights")
    device: str | None = param(None, help="torch device; none = cuda if available, else cpu")
    _model: Any = attrs.field(init=False, default=None, repr=False)
    _tokenizer: Any = attrs.field(init=False, default=None, repr=False)
    _image_config: dict = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        if importlib.util.find_spec("transformers") is None:
            raise ImportError(INSTALL)
        from transformers import CLIPModel, CLIPProcessor

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            model = CLIPModel.from_pretrained(self.path)
            processor = CLIPProcessor.from_pretrained(self.processor_path or self.path)
        except OSError as exc:
            where = self.processor_path or self.path
            raise OSError(f"reward.path: cannot load a CLIP model and processor from {where!r}: {exc}") from exc
        self._model = model.to(device=device, dtype=DTYPES[self.dtype]).eval().requires_grad_(False)
        self._tokenizer = processor.tokenizer
        self._image_config = processor.image_processor.to_dict()

    @property
    def model(self) -> Any:
        return self._model

    @torch.no_grad()
    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 4 or outputs.shape[1] != 3:
            raise ValueError("clip-score expects images (B, 3, H, W) in [0, 1]")
        if outputs.shape[0] != len(prompts):
            raise ValueError(f"clip-score got {outputs.shape[0]} images for {len(prompts)} prompts")
        device = next(self._model.parameters()).device
        dtype = next(self._model.parameters()).dtype
        max_length = min(
            int(self._tokenizer.model_max_length),
            int(self._model.config.text_config.max_position_embeddings),
        )
        cosines = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = list(prompts[start : start + self.batch_size])
            pixels = preprocess(outputs[start : start + self.batch_size].to(device), self._image_config)
            text = self._tokenizer(
                chunk, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
            ).to(device)
            out = self._model(pixel_values=pixels.to(dtype), input_ids=text["input_ids"], attention_mask=text["attention_mask"])
            image = out.image_embeds.float()
            words = out.text_embeds.float()
            cosines.append(F.cosine_similarity(image, words, dim=-1))
        cosine = torch.cat(cosines).cpu()
        scale = self._model.logit_scale.detach().float().exp().cpu()
        return RewardResult(scores=cosine * scale / self.divisor, details={"cosine": cosine})
