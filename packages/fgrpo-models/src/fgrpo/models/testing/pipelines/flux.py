"""Tiny ``FluxPipeline`` (CLIP + T5, guidance-distilled transformer) and ``FluxKontextPipeline``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from fgrpo.models.testing.pipelines._common import (
    FLUX_VAE_SCALING_FACTOR,
    FLUX_VAE_SHIFT_FACTOR,
    clip_config,
    finish,
    kl_vae,
    randomise,
    t5_encoder,
    tiny_clip_tokenizer,
    tiny_t5_tokenizer,
)

FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}


def build_tiny_flux_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    guidance_embeds: bool = True,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
    pipeline_class: str = "FluxPipeline",
) -> Any:
    """A tiny random ``FluxPipeline`` (FLUX.1-dev's structure: guidance embedding, 2x2 packed
    latents, resolution-dependent shift), saved to ``path`` if given; ``pipeline_class``
    ``FluxKontextPipeline`` makes FLUX.1 Kontext's (the same networks).

    Transformer: 1 double + 2 single blocks, 4 heads x 16, rope axes (4, 6, 6), in_channels 64
    (= 4 x 16 latent channels); T5 d_model 64 = joint_attention_dim; pooled 32 = CLIP hidden
    size. ``guidance_embeds=False`` gives FLUX.1-schnell's structure. The pipeline's default
    image side stays FluxPipeline's 1024: pass ``height``/``width`` (``resolution``) of 64.
    """
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

    # T5TokenizerFast: an alias in transformers 5 (T5Tokenizer is the fast one), absent from its typing
    from transformers import CLIPTextModel, T5TokenizerFast  # type: ignore[attr-defined]

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=64,
            pooled_projection_dim=32,
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 6, 6),
        )
        randomise(transformer)
        text_encoder = CLIPTextModel(clip_config())
        text_encoder_2 = t5_encoder(64)
        vae = kl_vae((8, 16, 16, 16), 16, 64, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR)
    with tempfile.TemporaryDirectory() as tmp:  # the fast T5 tokenizer FLUX pipelines expect
        tiny_t5_tokenizer().save_pretrained(tmp)
        tokenizer_2 = T5TokenizerFast.from_pretrained(tmp)
    pipe = getattr(diffusers, pipeline_class)(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    return finish(pipe, path, torch_dtype)


def build_tiny_flux_kontext_pipeline(path: str | os.PathLike[str] | None = None, **options: Any) -> Any:
    """A tiny random ``FluxKontextPipeline`` (FLUX.1 Kontext [dev]'s structure; the networks of
    :func:`build_tiny_flux_pipeline`), saved to ``path`` if given."""
    return build_tiny_flux_pipeline(path, pipeline_class="FluxKontextPipeline", **options)
