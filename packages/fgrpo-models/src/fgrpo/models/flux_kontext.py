"""``flux-kontext``: FLUX.1 Kontext [dev] (diffusers ``FluxKontextPipeline``) with a peft LoRA: image
editing, one source image per prompt (a :class:`fgrpo.core.media.Prompt`).

What differs from :mod:`fgrpo.models.flux` (checked in tests against ``pipe(image=...,
output_type="latent")``):

- each prompt's source image is resized (``source_resolution``, below), preprocessed by the
  pipeline's image processor and encoded by the VAE (the distribution's mode, as the pipeline's
  ``_encode_vae_image``); its latents travel in ``cond`` (``image_latents``, (B, 16, h, w), batch
  first, shared by both branches of true CFG) and are cached per prompt;
- the transformer sees the state's 2x2 packed tokens, then the source's in one sequence, with
  the source's image ids' first coordinate 1 (the pipeline's ``image_ids[..., 0] = 1``); only the
  state's tokens are read out (``noise_pred[:, :latents.size(1)]``);
- the time shift ``mu`` depends on the state's tokens only, the guidance embedding and true CFG
  are FLUX's.

``source_resolution``: ``preferred`` (the pipeline's ``_auto_resize``: the Kontext resolution
nearest the source's aspect ratio, about 1 M pixels), ``output`` (resized to the output's size,
as flow_grpo's ``train_flux_kontext.py`` resizes its reference images to the training
resolution), or ``[height, width]``. One run has one source size (the source latents are
batched); ``preferred`` with sources of different aspect ratios is refused before the first
rollout. The output's size is ``resolution`` (the pipeline's ``height``/``width`` with
``max_area = height x width``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core import media
from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx
from fgrpo.models.flux import FluxPolicy

SOURCE_RESOLUTIONS = ("preferred", "output")


def check_source_resolution(_inst: Any, _attribute: Any, value: Any) -> None:
    if value in SOURCE_RESOLUTIONS:
        return
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return
    raise ValueError(
        f"got {value!r}; allowed: preferred (the pipeline's own), output (the output's size) or [height, width]"
    )


def source_resolution_param(help_preferred: str) -> Any:
    return param(
        "preferred",
        validator=check_source_resolution,
        help=f"size the source images are resized to: preferred ({help_preferred}), output (the output's size, "
        "flow_grpo's), or [height, width]",
    )


SOURCE_RESAMPLES = ("lanczos", "bicubic")


def source_resample_param() -> Any:
    return param(
        "lanczos",
        choices=SOURCE_RESAMPLES,
        help="how sources are resized: lanczos (the pipelines' image processor) or bicubic (PIL's default resize, "
        "flow_grpo's ref_image.resize before its pipeline)",
    )


class SourceImages:
    """What the editing backbones share: the source size each prompt's images get, how they are
    resized, and the check that a run's sources share one size (their latents are batched)."""

    source_resample: str
    source_resolution: Any  # the host policy's recipe key
    size: tuple[int, int]  # the host policy's output size
    _pipeline: Any  # the host policy's pipeline
    _images: dx.PromptCache  # the host's cache of the sources' conditions, built after its other fields

    @property
    def image_cache(self) -> dx.PromptCache:
        return self._images

    def _source_size(self, image: Any) -> tuple[int, int]:
        """(height, width) a source is resized to, as ``pipe(image=...)`` does it: the recipe's size,
        the output's, or the pipeline's preferred size for the source (:meth:`_preferred_size`)."""
        if isinstance(self.source_resolution, (list, tuple)):
            return int(self.source_resolution[0]), int(self.source_resolution[1])
        if self.source_resolution == "output":
            return self.size
        return self._preferred_size(image)

    def _preferred_size(self, image: Any) -> tuple[int, int]:
        raise NotImplementedError

    def _resized(self, image: Any, height: int, width: int) -> Any:
        """The source at (height, width): the pipeline's image processor resize (Lanczos), or PIL's
        bicubic first (``source_resample: bicubic``; the processor's resize is then a no-op)."""
        if self.source_resample == "bicubic" and (image.height, image.width) != (height, width):
            from PIL import Image

            image = image.resize((width, height), Image.Resampling.BICUBIC)
        return self._pipeline.image_processor.resize(image, height, width)

    def source_sizes(self, prompts: Sequence[str]) -> dict[tuple[int, ...], list[str]]:
        """(height, width) of the resized sources -> the prompts whose sources get it."""
        sizes: dict[tuple[int, ...], list[str]] = {}
        for prompt in dict.fromkeys(prompts):
            for ref in media.source_images(prompt):
                sizes.setdefault(self._source_size(media.load_image(ref)), []).append(prompt)
        return sizes

    def check_prompts(self, prompts: Sequence[str]) -> list[str]:
        sizes = self.source_sizes(prompts)
        if len(sizes) <= 1:
            return []
        shown = "; ".join(
            " + ".join(f"{size[i]}x{size[i + 1]}" for i in range(0, len(size), 2))
            + f" for {media.where(ps[0])}"
            + (f" and {len(ps) - 1} more" if len(ps) > 1 else "")
            for size, ps in sizes.items()
        )
        return [
            f"model.source_resolution {self.source_resolution!r} resizes the sources to {len(sizes)} sizes ({shown}); "
            f"one run "
            "batches its sources' latents, so they need one size: set source_resolution to output or [height, width], "
            "or "
            "give sources of one aspect ratio"
        ]


@attrs.define(eq=False)
class FluxKontextPolicy(SourceImages, FluxPolicy):
    """FLUX.1 Kontext (diffusers) with LoRA: edits a source image per prompt; satisfies
    :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "FluxKontextPipeline"
    source_image_count: ClassVar[tuple[int, int]] = (1, 1)
    shared_condition_keys: ClassVar[tuple[str, ...]] = ("image_latents",)

    source_resolution: str | list[int] = source_resolution_param("the Kontext resolution nearest its aspect ratio")
    source_resample: str = source_resample_param()
    _images: dx.PromptCache = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._images = dx.PromptCache(self.prompt_cache_size)

    def _preferred_size(self, image: Any) -> tuple[int, int]:
        """The Kontext resolution nearest the source's aspect ratio."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        multiple = self.vae_scale_factor * 2
        height, width = self._pipeline.image_processor.get_default_height_width(image)
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        return height // multiple * multiple, width // multiple * multiple

    def _conditions(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        return self._images.get(prompts, self._encode_sources)

    def _encode_sources(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The VAE latents (B, 16, h, w) of each prompt's source image, as ``pipe(image=...)``
        prepares them (resized, preprocessed to [-1, 1], the latent distribution's mode, shifted
        and scaled)."""
        pipe = self._pipeline
        pixels = []
        for prompt in prompts:
            refs = media.source_images(prompt)
            if len(refs) != 1:
                raise ValueError(
                    f"flux-kontext: prompt {media.where(prompt)} has {len(refs)} source images; it takes exactly 1"
                )
            image = media.load_image(refs[0])
            height, width = self._source_size(image)
            pixels.append(pipe.image_processor.preprocess(self._resized(image, height, width), height, width))
        if len({tuple(p.shape) for p in pixels}) > 1:
            raise ValueError(
                f"flux-kontext: sources of several sizes in one batch "
                f"({sorted({tuple(p.shape[-2:]) for p in pixels})})"
            )
        vae = pipe.vae
        with torch.autocast(torch.device(self.device).type, enabled=False):
            latents = pipe._encode_vae_image(torch.cat(pixels).to(self.device, vae.dtype), generator=None)
        return {"image_latents": latents.float()}

    def _kontext_ids(self, text_tokens: int, source_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(text ids, state then source image ids) as the pipeline makes them."""
        key = (text_tokens, *source_shape)
        if key not in self._ids:
            text_ids, state_ids = self._non_batch_ids(text_tokens)
            h, w = source_shape
            source_ids = self._pipeline._prepare_latent_image_ids(1, h // 2, w // 2, self.device, state_ids.dtype)
            source_ids[..., 0] = 1
            self._ids[key] = (text_ids, torch.cat([state_ids, source_ids], dim=0))
        return self._ids[key]

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        embeds, source = cond["prompt_embeds"], cond["image_latents"]
        text_ids, image_ids = self._kontext_ids(embeds.shape[1], (source.shape[-2], source.shape[-1]))
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((x.shape[0],), self.guidance_scale, device=self.device, dtype=torch.float32)
        state = dx.pack_2x2(x)
        tokens = torch.cat([state, dx.pack_2x2(source.to(self.device, torch.float32))], dim=1)
        out = self._transformer_output(
            tokens,
            sigma,
            {"guidance": guidance, "txt_ids": text_ids, "img_ids": image_ids},
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=embeds,
        )
        return out[:, : state.shape[1]]


__all__ = [
    "FluxKontextPolicy",
    "SOURCE_RESAMPLES",
    "SOURCE_RESOLUTIONS",
    "SourceImages",
    "check_source_resolution",
    "source_resample_param",
    "source_resolution_param",
]
