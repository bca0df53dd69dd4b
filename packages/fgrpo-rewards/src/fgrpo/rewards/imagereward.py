"""``imagereward``: ImageReward v1.0 (Xu et al. 2023) in transformers' BLIP classes.

The ``image-reward`` package on PyPI pins ``timm==0.6.13`` and ``fairscale==0.4.13``, needs
torchvision and downloads its files at load time, so the published ``ImageReward.pt`` (hub
repository THUDM/ImageReward, with its ``med_config.json``) is mapped here onto a transformers
BlipVisionModel (BLIP's ViT-L/16) and BlipTextModel (BERT with cross-attention to the image) by
:func:`blip_to_hf`. The score is ImageReward's: the text encoder's [CLS] output, read with
cross-attention to every image token, through the 5-layer MLP head (no activations), then
standardised: (head - 0.16717362830052426) / 1.0333394966054072. Prompts are tokenised with
bert-base-uncased, padded and truncated to 35 tokens; images resized (shortest side 224, bicubic),
centre-cropped and normalised with OpenAI's mean/std, in torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.rewards.aesthetic import aesthetic_head
from fgrpo.rewards.clip import (
    DTYPES,
    OPENAI_MEAN,
    OPENAI_STD,
    check_images,
    device_key,
    dtype_key,
    loading_error,
    preprocess,
    require_transformers,
    resolve_device,
    shared,
)
from fgrpo.rewards.weights import read_state_dict, resolve_file

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward's standardisation of the head
MAX_LENGTH = 35

_VISION = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def blip_to_hf(state: Mapping[str, torch.Tensor]) -> tuple[dict, dict, dict]:
    """ImageReward's state dict as (BlipVisionModel, BlipTextModel, head) state dicts.

    BLIP's ViT keeps timm's names (``blocks.N.attn.qkv``, fused q/k/v in the same layout as
    transformers' BLIP); its BERT already uses transformers' BERT names. BLIP's projection heads
    (``vision_proj``, ``text_proj``) and the momentum encoders are not used by ImageReward.
    """
    vision, text, head = {}, {}, {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            rest = key.removeprefix("blip.visual_encoder.")
            if rest in _VISION:
                vision[_VISION[rest]] = value
                continue
            match = re.match(r"blocks\.(\d+)\.(.+)\.(weight|bias)$", rest)
            if match is None or match.group(2) not in _VISION_BLOCK:
                raise KeyError(f"unknown vision key {key}")
            layer, module, kind = match.groups()
            vision[f"encoder.layers.{layer}.{_VISION_BLOCK[module]}.{kind}"] = value
        elif key.startswith("blip.text_encoder."):
            if not key.endswith("position_ids"):  # a buffer BLIP saved; transformers rebuilds it
                text[key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp.layers."):
            head[key.removeprefix("mlp.layers.")] = value
    if not vision or not text or "0.weight" not in head:
        raise KeyError(
            "not an ImageReward state dict (needs blip.visual_encoder.*, blip.text_encoder.*, mlp.layers.*)"
        )
    return vision, text, head


def vision_config(vision: Mapping[str, torch.Tensor]) -> Any:
    """BLIP's ViT from its weights' shapes (BLIP's ViTs have 64-wide attention heads)."""
    from transformers import BlipVisionConfig

    width = int(vision["embeddings.position_embedding"].shape[-1])
    patch = int(vision["embeddings.patch_embedding.weight"].shape[-1])
    tokens = int(vision["embeddings.position_embedding"].shape[-2]) - 1
    layers = 1 + max(int(k.split(".")[2]) for k in vision if k.startswith("encoder.layers."))
    return BlipVisionConfig(
        hidden_size=width,
        intermediate_size=int(vision["encoder.layers.0.mlp.fc1.weight"].shape[0]),
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        image_size=patch * int(round(tokens**0.5)),
        patch_size=patch,
        layer_norm_eps=1e-6,
        hidden_act="gelu",
    )


def text_config(med: Mapping[str, Any], encoder_width: int) -> Any:
    """BlipTextConfig from BLIP's med_config.json (a BertConfig with cross-attention)."""
    from transformers import BlipTextConfig

    return BlipTextConfig(
        vocab_size=med["vocab_size"],
        hidden_size=med["hidden_size"],
        encoder_hidden_size=encoder_width,
        intermediate_size=med["intermediate_size"],
        num_hidden_layers=med["num_hidden_layers"],
        num_attention_heads=med["num_attention_heads"],
        max_position_embeddings=med["max_position_embeddings"],
        hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12),
        pad_token_id=med.get("pad_token_id", 0),
        bos_token_id=med.get("bos_token_id"),
        sep_token_id=med.get("sep_token_id"),
        is_decoder=True,  # is_decoder: transformers builds the cross-attention
    )


@attrs.frozen
class LoadedImageReward:
    vision: Any
    text: Any
    head: Any
    tokenizer: Any

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device


def load_imagereward(
    checkpoint: str, med_config: str, tokenizer: str, dtype: str, device: str | None
) -> LoadedImageReward:
    require_transformers()
    dev = resolve_device(device)

    def build() -> LoadedImageReward:
        from transformers import AutoTokenizer
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        state = read_state_dict(checkpoint, "reward.checkpoint")
        try:
            vision_state, text_state, head_state = blip_to_hf(state)
        except KeyError as exc:
            raise OSError(f"reward.checkpoint: {checkpoint!r}: {exc}") from exc
        med_path = resolve_file(med_config, "reward.med_config")
        try:
            med = json.loads(med_path.read_text())
        except (OSError, ValueError) as exc:
            raise OSError(f"reward.med_config: cannot read {str(med_path)!r}: {exc}") from exc
        from fgrpo.core.hub import pretrained_source  # absent files: one message at once

        source = pretrained_source(tokenizer, key="reward.tokenizer")
        try:
            words = AutoTokenizer.from_pretrained(source.location, **source.kwargs)
        except OSError as exc:
            raise loading_error("reward.tokenizer", tokenizer, "a BERT tokenizer", exc) from exc
        vision = BlipVisionModel(vision_config(vision_state))
        text = BlipTextModel(text_config(med, vision.config.hidden_size), add_pooling_layer=False)
        head = aesthetic_head(int(head_state["0.weight"].shape[1]))  # ImageReward's MLP is the same stack
        for part, weights, name in (
            (vision, vision_state, "vision"),
            (text, text_state, "text"),
            (head, head_state, "head"),
        ):
            try:
                part.load_state_dict(weights, strict=True)
            except RuntimeError as exc:
                first = " ".join(str(exc).split())[:400]
                raise OSError(
                    f"reward.checkpoint: the {name} weights of {checkpoint!r} do not fit {med_config!r}: {first}"
                ) from exc
        # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method
        vision, text = [m.to(device=dev, dtype=DTYPES[dtype]).eval().requires_grad_(False) for m in (vision, text)]  # type: ignore[call-arg]
        return LoadedImageReward(vision, text, head.to(dev).eval().requires_grad_(False), words)

    return shared(("imagereward", checkpoint, med_config, tokenizer, dtype, str(dev)), build)


@attrs.define
class ImageReward:
    """ImageReward v1.0: a standardised human-preference score, about -2 to 2 (0 = the mean of
    its training images). Details: none beyond the score."""

    checkpoint: str = param("THUDM/ImageReward:ImageReward.pt", help="ImageReward.pt: a file or owner/repo:filename")
    med_config: str = param(
        "THUDM/ImageReward:med_config.json", help="its BLIP text-encoder config: a file or owner/repo:filename"
    )
    tokenizer: str = param("bert-base-uncased", help="hub id or folder of the BERT tokenizer")
    batch_size: int = param(32, ge=1, help="images scored per forward pass")
    dtype: str = dtype_key("the BLIP weights (the head runs in float32)")
    device: str | None = device_key()
    _model: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._model = load_imagereward(self.checkpoint, self.med_config, self.tokenizer, self.dtype, self.device)

    @torch.no_grad()
    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        check_images(outputs, prompts, "imagereward")
        m = self._model
        size = int(m.vision.config.image_size)
        config = {
            "size": {"shortest_edge": size},
            "crop_size": {"height": size, "width": size},
            "image_mean": OPENAI_MEAN,
            "image_std": OPENAI_STD,
        }
        dtype = next(m.vision.parameters()).dtype
        raw = []
        for start in range(0, len(prompts), self.batch_size):
            pixels = preprocess(outputs[start : start + self.batch_size].to(m.device), config).to(dtype)
            image = m.vision(pixel_values=pixels).last_hidden_state
            tokens = m.tokenizer(
                list(prompts[start : start + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=MAX_LENGTH,
                return_tensors="pt",
            ).to(m.device)
            text = m.text(
                input_ids=tokens["input_ids"],
                attention_mask=tokens["attention_mask"],
                encoder_hidden_states=image,
                encoder_attention_mask=torch.ones(image.shape[:-1], dtype=torch.long, device=m.device),
            ).last_hidden_state[:, 0, :]
            raw.append(m.head(text.float()).squeeze(-1))
        return RewardResult(scores=((torch.cat(raw) - MEAN) / STD).cpu())
