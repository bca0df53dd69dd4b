"""The CLIP family: ``clip-score``, ``pickscore`` and what they share with ``aesthetic``, ``hpsv2``
and ``geneval`` (loading once per process, preprocessing in torch, batched embeddings).

Needs the ``[clip]`` extra (transformers), imported only when a reward is built. No CLIP weights
ship on PyPI: ``path`` names a hub model (downloaded by transformers on first use, honouring
HF_HUB_OFFLINE / HF_HOME) or a folder written by ``save_pretrained``.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch
import torch.nn.functional as F

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult

INSTALL = 'pip install "fgrpo-rewards[clip]"'

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def dtype_key(what: str = "the weights") -> Any:
    """The ``dtype`` recipe key every model reward has."""
    return param("float32", choices=tuple(DTYPES), help=f"dtype of {what}")


def device_key() -> Any:
    """The ``device`` recipe key every model reward has."""
    return param(None, help="torch device; none = this process's cuda device if any, else cpu")


def require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        raise ImportError(INSTALL)


def resolve_device(device: str | None) -> torch.device:
    """``None``: this process's CUDA device (accelerate sets it per process) or the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


# --- one copy of every model per process -------------------------------------------------------

_MODELS: dict[tuple, Any] = {}
_LOCK = threading.RLock()  # a shared object may load another (geneval: the colour CLIP)


def shared(key: tuple, build: Callable[[], Any]) -> Any:
    """The object built for ``key`` in this process (built on first use). The train and
    evaluation rewards, two rewards on the same CLIP, and ``serve-reward`` share one copy."""
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = build()
        return _MODELS[key]


def loading_error(key: str, where: str, what: str, exc: Exception) -> OSError:
    return OSError(f"{key}: cannot load {what} from {where!r}: {exc}")


@attrs.frozen
class CLIP:
    """A loaded CLIPModel (eval mode, no grad) with its tokenizer and image-processor settings."""

    model: Any
    tokenizer: Any
    image_config: dict

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_length(self) -> int:
        return min(int(self.tokenizer.model_max_length), int(self.model.config.text_config.max_position_embeddings))

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.detach().float().exp().cpu()


def load_clip(path: str, processor_path: str | None, dtype: str, device: str | None, key: str = "reward.path") -> CLIP:
    """A CLIPModel and its processor from a hub id or folder, once per process."""
    require_transformers()
    dev = resolve_device(device)

    def build() -> CLIP:
        from transformers import CLIPModel, CLIPProcessor

        from fgrpo.core.hub import pretrained_source  # absent weights: one message at once, no retries

        model_from = pretrained_source(path, key=key)
        processor_from = (
            pretrained_source(processor_path, key="reward.processor_path") if processor_path else model_from
        )
        try:
            model = CLIPModel.from_pretrained(model_from.location, **model_from.kwargs)
            processor = CLIPProcessor.from_pretrained(processor_from.location, **processor_from.kwargs)
        except OSError as exc:
            raise loading_error(key, processor_path or path, "a CLIP model and processor", exc) from exc
        # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method
        model = model.to(device=dev, dtype=DTYPES[dtype]).eval().requires_grad_(False)  # type: ignore[call-arg]
        return CLIP(model, processor.tokenizer, processor.image_processor.to_dict())

    return shared(("clip", path, processor_path or path, dtype, str(dev)), build)


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


def preprocess(images: torch.Tensor, config: Mapping[str, Any], mode: str = "bicubic") -> torch.Tensor:
    """CLIP's resize / centre crop / normalise on (B, 3, H, W) floats in [0, 1], in torch.

    Follows the processor's ``preprocessor_config.json`` (``size``, ``crop_size``,
    ``image_mean``, ``image_std``); antialiased resizing, bicubic like the PIL path (``mode``
    bilinear: torchvision's ``T.Resize`` on tensors, as flow_grpo's scorers use it).
    """
    x = images.float().clamp(0, 1)
    if config.get("do_resize", True) and config.get("size") is not None:
        size = _size(config["size"], "size")
        if isinstance(size, int):  # shortest edge -> size, aspect ratio kept (as transformers does)
            h, w = x.shape[-2:]
            size = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
        if tuple(x.shape[-2:]) != tuple(size):
            x = F.interpolate(x, size=size, mode=mode, antialias=True, align_corners=False).clamp(0, 1)
    if config.get("do_center_crop", True) and config.get("crop_size") is not None:
        crop = _size(config["crop_size"], "crop_size")
        ch, cw = (crop, crop) if isinstance(crop, int) else crop  # a single number crops a square
        h, w = x.shape[-2:]
        top, left = max((h - ch) // 2, 0), max((w - cw) // 2, 0)
        x = x[..., top : top + ch, left : left + cw]
    if config.get("do_normalize", True):
        mean = torch.tensor(config.get("image_mean", OPENAI_MEAN), dtype=x.dtype, device=x.device)
        std = torch.tensor(config.get("image_std", OPENAI_STD), dtype=x.dtype, device=x.device)
        x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    return x


def _features(out: Any) -> torch.Tensor:
    # transformers 5 returns a ModelOutput whose pooler_output is the projected embedding
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def check_images(outputs: Any, prompts: Sequence[str], name: str) -> None:
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 4 or outputs.shape[1] != 3:
        shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise ValueError(f"{name} expects images (B, 3, H, W) in [0, 1], got {shape}")
    if outputs.shape[0] != len(prompts):
        raise ValueError(f"{name} got {outputs.shape[0]} images for {len(prompts)} prompts")


@torch.no_grad()
def image_embeddings(clip: CLIP, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(B, D) float32 unit-norm image embeddings; images preprocessed on the model's device."""
    parts = []
    for start in range(0, images.shape[0], batch_size):
        pixels = preprocess(images[start : start + batch_size].to(clip.device), clip.image_config)
        parts.append(_features(clip.model.get_image_features(pixel_values=pixels.to(clip.dtype))).float())
    return F.normalize(torch.cat(parts), dim=-1)


@torch.no_grad()
def text_embeddings(clip: CLIP, texts: Sequence[str], batch_size: int) -> torch.Tensor:
    """(B, D) float32 unit-norm text embeddings (padded and truncated to the text model's length)."""
    parts = []
    for start in range(0, len(texts), batch_size):
        tokens = clip.tokenizer(
            list(texts[start : start + batch_size]),
            padding="max_length",
            truncation=True,
            max_length=clip.max_length,
            return_tensors="pt",
        ).to(clip.device)
        out = clip.model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        parts.append(_features(out).float())
    return F.normalize(torch.cat(parts), dim=-1)


def similarity_reward(
    clip: CLIP, outputs: Any, prompts: Sequence[str], batch_size: int, divisor: float, name: str
) -> RewardResult:
    """score = cos(image, prompt) x exp(logit_scale) / divisor; details ``cosine``."""
    check_images(outputs, prompts, name)
    cosine = (image_embeddings(clip, outputs, batch_size) * text_embeddings(clip, prompts, batch_size)).sum(-1).cpu()
    return RewardResult(scores=cosine * clip.logit_scale / divisor, details={"cosine": cosine})


class HoldsCLIP:
    """A reward around a loaded CLIP (``_clip``); ``model`` is its network."""

    __slots__ = ()
    _clip: CLIP

    @property
    def model(self) -> Any:
        return self._clip.model


class _Similarity(HoldsCLIP):
    """CLIPScore and PickScore: a CLIPModel from ``path`` (``processor_path``) scoring
    cos(image, prompt) x exp(logit_scale) / ``divisor``, reported under ``reward_name``."""

    __slots__ = ()
    reward_name: ClassVar[str]
    path: str
    processor_path: str | None
    divisor: float
    batch_size: int
    dtype: str
    device: str | None

    def __attrs_post_init__(self) -> None:
        # the attrs classes built on this mixin declare the _clip slot
        self._clip = load_clip(self.path, self.processor_path, self.dtype, self.device)  # type: ignore[misc]

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        return similarity_reward(self._clip, outputs, prompts, self.batch_size, self.divisor, self.reward_name)


@attrs.define
class CLIPScore(_Similarity):
    """score = cos(image embedding, text embedding) x exp(logit_scale) / divisor.

    With the default divisor 100 and OpenAI CLIP (exp(logit_scale) = 100) the score is the
    cosine similarity itself, about 0.2-0.35 for matching pairs. flow_grpo's ``clip_score`` divides
    CLIP's logits by 30: set ``divisor: 30`` to reproduce its scale. Images are preprocessed in
    torch on the model's device (resize, crop, normalise as the model's processor configures);
    prompts are tokenised with the processor's tokenizer, padded and truncated to the text
    model's length. Details: ``cosine`` (B,).
    """

    reward_name: ClassVar[str] = "clip-score"
    path: str = param("openai/clip-vit-large-patch14", help="hub id or local folder of a CLIPModel")
    processor_path: str | None = param(None, help="hub id or folder of its CLIPProcessor; none = path")
    divisor: float = param(100.0, gt=0, help="the logits are divided by this (flow_grpo: 30)")
    batch_size: int = param(32, ge=1, help="images scored per forward pass")
    dtype: str = dtype_key("the CLIP weights")
    device: str | None = device_key()
    _clip: Any = attrs.field(init=False, default=None, repr=False)


@attrs.define
class PickScore(_Similarity):
    """PickScore v1 (Kirstain et al. 2023): a CLIP-H fine-tuned on human preferences.

    score = exp(logit_scale) x cos(image, prompt) / divisor, as flow_grpo computes it (its
    ``pickscore`` divides by 26, so typical images score about 0.8-0.9). The model is
    ``yuvalkirstain/PickScore_v1``; its processor is LAION's CLIP-ViT-H-14 one (resize 224
    bicubic, centre crop, OpenAI mean/std), applied in torch on the model's device. Details:
    ``cosine`` (B,).
    """

    reward_name: ClassVar[str] = "pickscore"
    path: str = param("yuvalkirstain/PickScore_v1", help="hub id or folder of the PickScore CLIPModel")
    processor_path: str | None = param(
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", help="hub id or folder of its processor; none = path"
    )
    divisor: float = param(26.0, gt=0, help="the logits are divided by this (flow_grpo: 26)")
    batch_size: int = param(32, ge=1, help="images scored per forward pass")
    dtype: str = dtype_key("the weights")
    device: str | None = device_key()
    _clip: Any = attrs.field(init=False, default=None, repr=False)
