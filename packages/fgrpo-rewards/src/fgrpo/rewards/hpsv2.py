"""``hpsv2``: Human Preference Score v2 / v2.1 (Wu et al. 2023) in transformers' CLIPModel.

The published HPSv2 checkpoints (``HPS_v2_compressed.pt``, ``HPS_v2.1_compressed.pt`` in the
xswu/HPSv2 hub repository) are open_clip ViT-H-14 state dicts. The ``hpsv2`` package on PyPI pins
``pytest==7.2.0`` and ``protobuf<4`` and needs torchvision, so instead the weights are mapped here
onto a transformers CLIPModel built from LAION's CLIP-ViT-H-14 config (:func:`open_clip_to_hf`),
and scored the way HPSv2 scores: the cosine of the unit image and text embeddings, no logit scale
(``img_score.py``: ``image_features @ text_features.T``). HPSv2's preprocessing (resize the
shortest side to 224, bicubic with antialiasing, centre crop, OpenAI mean/std) runs in torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.rewards.clip import (
    CLIP,
    DTYPES,
    HoldsCLIP,
    check_images,
    device_key,
    dtype_key,
    image_embeddings,
    loading_error,
    require_transformers,
    resolve_device,
    shared,
    text_embeddings,
)
from fgrpo.rewards.weights import read_state_dict

_TOWERS = {"visual.transformer.": "vision_model.encoder.", "transformer.": "text_model.encoder."}
_BLOCK = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_DIRECT = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",  # transformers' spelling
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}


def open_clip_to_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict (ViT image tower, its own text tower) as CLIPModel's.

    The fused attention input projection (``in_proj_weight``: q, k, v stacked) is split; the
    projections, stored as (width, embed) matrices multiplied on the right, are transposed into
    Linear weights. Keys open_clip keeps but CLIPModel does not (``attn_mask``) are dropped; any
    other unknown key is an error, so a checkpoint of another architecture is not half loaded.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state.items():
        if key in _DIRECT:
            out[_DIRECT[key]] = value
        elif key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.t().contiguous()
        elif key == "attn_mask" or key.endswith(".attn_mask"):
            continue
        else:
            match = re.match(r"(visual\.transformer\.|transformer\.)resblocks\.(\d+)\.(.+)$", key)
            if match is None:
                unknown.append(key)
                continue
            tower, layer, rest = match.groups()
            prefix = f"{_TOWERS[tower]}layers.{layer}."
            if rest.startswith("attn.in_proj_"):
                kind = rest.rsplit("_", 1)[1]  # weight or bias
                for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0), strict=True):
                    out[f"{prefix}self_attn.{name}.{kind}"] = part.contiguous()
                continue
            module, _, kind = rest.rpartition(".")
            if module not in _BLOCK:
                unknown.append(key)
                continue
            out[f"{prefix}{_BLOCK[module]}.{kind}"] = value
    if unknown:
        raise KeyError(f"not an open_clip ViT CLIP state dict; unknown keys: {', '.join(sorted(unknown)[:5])}")
    if "vision_model.embeddings.class_embedding" in out:
        out["vision_model.embeddings.class_embedding"] = out["vision_model.embeddings.class_embedding"].reshape(-1)
    return out


def load_hps(checkpoint: str, path: str, dtype: str, device: str | None) -> CLIP:
    """CLIPModel(config of ``path``) with the open_clip weights of ``checkpoint``; once per process."""
    require_transformers()
    dev = resolve_device(device)

    def build() -> CLIP:
        from transformers import CLIPConfig, CLIPModel, CLIPProcessor

        from fgrpo.core.hub import pretrained_source  # absent files: one message at once

        source = pretrained_source(path, key="reward.path")
        try:
            config = CLIPConfig.from_pretrained(source.location, **source.kwargs)
            processor = CLIPProcessor.from_pretrained(source.location, **source.kwargs)
        except OSError as exc:
            raise loading_error("reward.path", path, "a CLIP config and processor", exc) from exc
        state = read_state_dict(checkpoint, "reward.checkpoint")
        try:
            mapped = open_clip_to_hf(state)
            model = CLIPModel(config)
            missing, unexpected = model.load_state_dict(mapped, strict=False)
        except (KeyError, RuntimeError) as exc:
            first = " ".join(str(exc).split())[:400]
            raise OSError(f"reward.checkpoint: {checkpoint!r} does not fit the CLIP of {path!r}: {first}") from exc
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise OSError(
                f"reward.checkpoint: {checkpoint!r} does not fit the CLIP of {path!r}: missing "
                f"{missing[:4]}, unexpected {unexpected[:4]}"
            )
        # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method
        model = model.to(device=dev, dtype=DTYPES[dtype]).eval().requires_grad_(False)  # type: ignore[call-arg]
        return CLIP(model, processor.tokenizer, processor.image_processor.to_dict())

    return shared(("hpsv2", checkpoint, path, dtype, str(dev)), build)


@attrs.define
class HPSv2(HoldsCLIP):
    """score = cos(image, prompt) of the HPSv2 CLIP, about 0.2-0.35 (HPS v2.1 on good images ~0.3).
    Details: none beyond the score.
    """

    checkpoint: str = param(
        "xswu/HPSv2:HPS_v2.1_compressed.pt",
        help="the open_clip checkpoint: a file or owner/repo:filename (HPS_v2_compressed.pt for v2.0)",
    )
    path: str = param(
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        help="hub id or folder giving the CLIP config, tokenizer and processor",
    )
    batch_size: int = param(32, ge=1, help="images scored per forward pass")
    dtype: str = dtype_key("the weights")
    device: str | None = device_key()
    _clip: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._clip = load_hps(self.checkpoint, self.path, self.dtype, self.device)

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        check_images(outputs, prompts, "hpsv2")
        image = image_embeddings(self._clip, outputs, self.batch_size)
        text = text_embeddings(self._clip, prompts, self.batch_size)
        return RewardResult(scores=(image * text).sum(-1).cpu())
