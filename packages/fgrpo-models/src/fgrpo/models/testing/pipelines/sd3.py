"""A tiny ``StableDiffusion3Pipeline`` (CLIP x2 + T5, SD3 transformer)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from fgrpo.models.testing.pipelines._common import (
    SD3_VAE_SCALING_FACTOR,
    SD3_VAE_SHIFT_FACTOR,
    clip_config,
    finish,
    kl_vae,
    t5_encoder,
    tiny_clip_tokenizer,
    tiny_t5_tokenizer,
)


def build_tiny_sd3_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    sample_size: int = 8,
    num_layers: int = 2,
    sd35: bool = False,
    shift: float = 3.0,
    vae_block_out_channels: Sequence[int] = (8, 16, 16, 16),
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random ``StableDiffusion3Pipeline`` (about 2 MB), saved to ``path`` if given.

    - ``sample_size``: the transformer's latent size; the default image side is
      ``sample_size * 2 ** (len(vae_block_out_channels) - 1)`` (8 x 8 = 64 px by default).
    - ``sd35``: SD3.5-style blocks (``qk_norm="rms_norm"``, a dual-attention first layer).
    - ``shift``: the scheduler's time shift (``FlowMatchEulerDiscreteScheduler(shift=...)``).
    - ``vae_block_out_channels``: one block per entry; the VAE downsamples by 2 per extra block.
    - ``seed``: weights are drawn from a private RNG; the global torch RNG is left untouched.

    Transformer: 4 heads x 16, joint_attention_dim 64 (= T5 d_model), pooled 64 (= 2 x CLIP
    projection 32), patch 2, 16 latent channels. Returns the in-memory pipeline (also when saved).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    patch_size = 2
    blocks = tuple(int(c) for c in vae_block_out_channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=sample_size,
            patch_size=patch_size,
            in_channels=16,
            out_channels=16,
            num_layers=num_layers,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=64,
            pooled_projection_dim=64,
            pos_embed_max_size=max(16, sample_size // patch_size),
            **({"qk_norm": "rms_norm", "dual_attention_layers": (0,)} if sd35 else {}),
        )
        text_encoder = CLIPTextModelWithProjection(clip_config())
        text_encoder_2 = CLIPTextModelWithProjection(clip_config())
        text_encoder_3 = t5_encoder(64)
        vae = kl_vae(blocks, 16, sample_size * 2 ** (len(blocks) - 1), SD3_VAE_SCALING_FACTOR, SD3_VAE_SHIFT_FACTOR)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tiny_t5_tokenizer(),
    )
    return finish(pipe, path, torch_dtype)
