"""``qwen-image-edit``: Qwen-Image-Edit (diffusers ``QwenImageEditPipeline``) and
``qwen-image-edit-plus``: Qwen-Image-Edit-2509/2511 (``QwenImageEditPlusPipeline``, one to three
source images), with a peft LoRA; a prompt is a :class:`fgrpo.core.media.Prompt` with its source
images.

What differs from :mod:`fgrpo.models.qwen_image` (checked in tests against ``pipe(image=...,
output_type="latent")``):

- prompts go through the edit pipelines' template into Qwen2.5-VL *with the source images*: the
  VL encoder's image tokens are part of the prompt embeddings (Edit: the source at its resized
  size; Plus: each source at 384 x 384 pixels of its aspect ratio, after "Picture k:"), so text
  embeddings are cached per prompt (text and images) and the negative prompt is encoded with each
  prompt's sources, as the pipelines do. They are padded to ``max_sequence_length`` (image and
  text tokens; a longer prompt is an error, never cut);
- each source is resized (``source_resolution``), preprocessed and VAE-encoded (the mode, then
  normalised per channel), and travels in ``cond`` (``image_latents`` (Plus: ``image_latents_k``),
  (B, 16, h, w), batch first, shared by both branches of true CFG); the transformer sees the
  state's 2x2 packed tokens, then the sources', with ``img_shapes`` listing each; only the state's
  tokens are read out;
- true CFG with the norm rescale, the time shift and decoding are Qwen-Image's.

``source_resolution``: ``preferred`` (the pipelines': 1024 x 1024 pixels of the source's aspect
ratio, ``calculate_dimensions``), ``output`` (the output's size), or ``[height, width]``
(flow_grpo's ``train_qwenimage_edit.py`` squashes its sources to the training resolution, which
its pipeline then resizes to 1024 x 1024: ``[1024, 1024]``). One run has one source size per
source slot (their latents are batched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core import media
from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx
from fgrpo.models.flux_kontext import SourceImages, source_resample_param, source_resolution_param
from fgrpo.models.qwen_image import QwenImagePolicy

#: the pipelines' source area (``calculate_dimensions(1024 * 1024, ratio)``) and Plus's VL input area
VAE_IMAGE_AREA = 1024 * 1024
CONDITION_IMAGE_AREA = 384 * 384


def calculate_dimensions(pipeline: Any, area: int, ratio: float) -> tuple[int, int]:
    """(height, width) of ``area`` pixels at ``ratio`` = width / height, multiples of 32: the
    pipeline's own ``calculate_dimensions`` (called through its module, so its rounding is its)."""
    import sys

    width, height, *_ = sys.modules[type(pipeline).__module__].calculate_dimensions(area, ratio)
    return int(height), int(width)


@attrs.define(eq=False)
class QwenImageEditPolicy(SourceImages, QwenImagePolicy):
    """Qwen-Image-Edit (diffusers) with LoRA: edits one source image per prompt; satisfies
    :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "QwenImageEditPipeline"
    source_image_count: ClassVar[tuple[int, int]] = (1, 1)
    shared_condition_keys: ClassVar[tuple[str, ...]] = ("image_latents",)
    text_sees_images = True

    source_resolution: str | list[int] = source_resolution_param(
        "1024 x 1024 pixels of its aspect ratio, the pipeline's"
    )
    source_resample: str = source_resample_param()
    max_sequence_length: int = param(
        1024,
        ge=1,
        le=16384,
        help="prompt tokens after the template: the VL encoder's image tokens and the text's (padded to this; longer "
        "is an error)",
    )
    _images: dx.PromptCache = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._images = dx.PromptCache(self.prompt_cache_size)

    # --- sizes ------------------------------------------------------------------------------------

    def _preferred_size(self, image: Any) -> tuple[int, int]:
        """1024 x 1024 pixels of the source's aspect ratio, the pipeline's."""
        return calculate_dimensions(self._pipeline, VAE_IMAGE_AREA, image.width / image.height)

    def _vl_images(self, prompt: str) -> list[Any]:
        """What the VL encoder sees of a prompt's sources: the source resized as for the VAE."""
        return [self._resized(image, *self._source_size(image)) for image in self._sources(prompt)]

    def _sources(self, prompt: str) -> list[Any]:
        refs = media.source_images(prompt)
        least, most = self.source_image_count
        if not least <= len(refs) <= most:
            raise ValueError(
                f"{self._name()}: prompt {media.where(prompt)} has {len(refs)} source images; it takes {least} to "
                f"{most}"
            )
        return [media.load_image(ref) for ref in refs]

    def _name(self) -> str:
        return "qwen-image-edit"

    # --- text and images --------------------------------------------------------------------------

    def _negative_prompts(self, prompts: list[str]) -> list[str]:
        """The negative prompt with each prompt's sources (the pipelines encode it with the image)."""
        return [media.Prompt(self.negative_prompt, images=media.source_images(p)) for p in prompts]

    def _vl_embeds(self, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [media.text_of(p) for p in prompts]
        images = [image for p in prompts for image in self._vl_images(p)]
        return self._pipeline._get_qwen_prompt_embeds(texts, image=images, device=device)

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, mask = self._vl_embeds(prompts, device)
        width = self.max_sequence_length
        lengths = mask.sum(dim=1)
        if int(lengths.max()) > width:
            i = int(lengths.argmax())
            raise ValueError(
                f"{self._name()}: prompt {media.where(prompts[i])} is {int(lengths[i])} tokens with its image tokens; "
                f"model.max_sequence_length is {width}: raise it (the sources' VL tokens grow with their size)"
            )
        embeds, mask = embeds[:, :width], mask[:, :width]
        pad = width - embeds.shape[1]
        if pad:
            embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], pad, embeds.shape[2])], dim=1)
            mask = torch.cat([mask, mask.new_zeros(mask.shape[0], pad)], dim=1)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def _conditions(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        return self._images.get(prompts, self._encode_sources)

    def _latent_keys(self, count: int) -> list[str]:
        return ["image_latents"]

    def _encode_sources(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The normalised VAE latents (B, 16, h, w) of each source, as ``pipe(image=...)`` makes
        them (resized, preprocessed to [-1, 1], the distribution's mode, per-channel mean and std)."""
        pipe = self._pipeline
        per_slot: list[list[torch.Tensor]] = []
        for prompt in prompts:
            for k, image in enumerate(self._sources(prompt)):
                height, width = self._source_size(image)
                pixels = pipe.image_processor.preprocess(self._resized(image, height, width), height, width)
                if k == len(per_slot):
                    per_slot.append([])
                per_slot[k].append(pixels)
        keys = self._latent_keys(len(per_slot))
        if len(per_slot) != len(keys) or any(len(slot) != len(prompts) for slot in per_slot):
            raise ValueError(f"{self._name()}: the prompts of one batch must have as many source images each")
        vae = pipe.vae
        out = {}
        for key, slot in zip(keys, per_slot, strict=True):
            if len({tuple(p.shape) for p in slot}) > 1:
                raise ValueError(
                    f"{self._name()}: sources of several sizes in one batch "
                    f"({sorted({tuple(p.shape[-2:]) for p in slot})})"
                )
            with torch.autocast(torch.device(self.device).type, enabled=False):
                latents = pipe._encode_vae_image(
                    torch.cat(slot).unsqueeze(2).to(self.device, vae.dtype), generator=None
                )
            out[key] = latents[:, :, 0].float()
        return out

    # --- the transformer ----------------------------------------------------------------------------

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        mask = cond["prompt_embeds_mask"]
        longest = int(mask.sum(dim=1).max())
        embeds, mask = cond["prompt_embeds"][:, :longest], mask[:, :longest]
        h, w = self._latent_shape[-2:]
        sources = [cond[k].to(self.device, torch.float32) for k in self._latent_keys(3) if k in cond]
        state = dx.pack_2x2(x)
        tokens = torch.cat([state, *[dx.pack_2x2(s) for s in sources]], dim=1)
        shapes = [(1, h // 2, w // 2)] + [(1, s.shape[-2] // 2, s.shape[-1] // 2) for s in sources]
        masked = self.text_padding_mask and not bool(mask.all())
        as_given = {"encoder_hidden_states_mask": mask if masked else None, "img_shapes": [shapes] * x.shape[0]}
        return self._transformer_output(tokens, sigma, as_given, encoder_hidden_states=embeds)[:, : state.shape[1]]


@attrs.define(eq=False)
class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    """Qwen-Image-Edit-2509/2511 (diffusers ``QwenImageEditPlusPipeline``) with LoRA: edits with one
    to three source images per prompt (the same number in one run); satisfies
    :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "QwenImageEditPlusPipeline"
    source_image_count: ClassVar[tuple[int, int]] = (1, 3)
    shared_condition_keys: ClassVar[tuple[str, ...]] = ("image_latents_0", "image_latents_1", "image_latents_2")

    def _name(self) -> str:
        return "qwen-image-edit-plus"

    def _vl_images(self, prompt: str) -> list[Any]:
        """Plus's VL input: each source at 384 x 384 pixels of its aspect ratio."""
        pipe = self._pipeline
        return [
            pipe.image_processor.resize(
                image, *calculate_dimensions(pipe, CONDITION_IMAGE_AREA, image.width / image.height)
            )
            for image in self._sources(prompt)
        ]

    def _vl_embeds(self, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # the pipeline numbers a prompt's images ("Picture 1: ..."): one prompt per call
        rows = [
            self._pipeline._get_qwen_prompt_embeds([media.text_of(p)], image=self._vl_images(p), device=device)
            for p in prompts
        ]
        width = max(e.shape[1] for e, _ in rows)
        embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, width - e.shape[1])) for e, _ in rows])
        mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for _, m in rows])
        return embeds, mask

    def _latent_keys(self, count: int) -> list[str]:
        return [f"image_latents_{k}" for k in range(count)]

    def check_prompts(self, prompts: Sequence[str]) -> list[str]:
        counts = {len(media.source_images(p)) for p in prompts}
        if len(counts) > 1:
            return [
                f"qwen-image-edit-plus: the prompts have {sorted(counts)} source images; one run batches them, so "
                f"every prompt needs as many"
            ]
        return super().check_prompts(prompts)

    def source_sizes(self, prompts: Sequence[str]) -> dict[tuple[int, ...], list[str]]:
        """(h1, w1, h2, w2, ...): the sizes of every slot (each slot is batched on its own)."""
        sizes: dict[tuple[int, ...], list[str]] = {}
        for prompt in dict.fromkeys(prompts):
            key = tuple(
                v for image in map(media.load_image, media.source_images(prompt)) for v in self._source_size(image)
            )
            sizes.setdefault(key, []).append(prompt)
        return sizes


__all__ = ["QwenImageEditPlusPolicy", "QwenImageEditPolicy", "calculate_dimensions"]
