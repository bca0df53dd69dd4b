"""A tiny ``ZImagePipeline`` (Qwen3 text encoder)."""

from __future__ import annotations

import os
from typing import Any

import torch

from fgrpo.models.testing.pipelines._common import (
    FLUX_VAE_SCALING_FACTOR,
    FLUX_VAE_SHIFT_FACTOR,
    finish,
    kl_vae,
    qwen3_config,
    randomise,
    tiny_qwen3_tokenizer,
)


def build_tiny_z_image_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    shift: float = 3.0,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random ``ZImagePipeline`` (Z-Image / Z-Image-Turbo: the same architecture; Turbo is
    run without guidance and with fewer steps), saved to ``path`` if given.

    Text encoder: a 2-layer ``Qwen3Model`` (hidden 16; the pipeline reads its second-to-last hidden
    state), :func:`tiny_qwen3_tokenizer`. Transformer: ``ZImageTransformer2DModel`` (dim 32, 2
    heads, 2 layers + 1 refiner layer per stream, patch 2, 16 latent channels). VAE: FLUX.1's
    ``AutoencoderKL`` normalisation. Scheduler: ``FlowMatchEulerDiscreteScheduler(shift=shift)``
    (Z-Image-Turbo's: a fixed shift 3).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
    from transformers import Qwen3Model

    tokenizer = tiny_qwen3_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3Model(qwen3_config(tokenizer))
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=16,
            axes_dims=[4, 6, 6],
            axes_lens=[256, 32, 32],
        )
        randomise(transformer)
        vae = kl_vae((8, 16, 16, 16), 16, 64, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR)
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return finish(pipe, path, torch_dtype)
