"""Tiny ``WanPipeline`` (UMT5, Wan 2.1) and Wan 2.2 T2V-A14B (two experts), I2V-A14B and TI2V-5B."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from fgrpo.models.testing.pipelines._common import finish, randomise, t5_encoder, tiny_t5_tokenizer


def _wan_transformer(in_channels: int = 16, out_channels: int = 16) -> Any:
    """A tiny random ``WanTransformer3DModel``: patch (1, 2, 2), 2 heads x 12, 2 layers, text_dim 32."""
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    randomise(transformer)
    return transformer


def _wan_tokenizer() -> Any:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tiny_t5_tokenizer().save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


#: Wan 2.2's VAE (TI2V-5B): 48 latent channels, 16x spatial compression (a 2x2 patchify around
#: the 8x network), residual blocks; per-channel statistics drawn for the tiny one
WAN22_VAE = {
    "z_dim": 48,
    "is_residual": True,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "in_channels": 12,
    "out_channels": 12,
}


def _wan_vae(z_dim: int = 16, **overrides: Any) -> Any:
    from diffusers import AutoencoderKLWan

    extra: dict[str, Any] = dict(overrides)
    if z_dim != 16:
        g = torch.Generator().manual_seed(z_dim)
        extra["latents_mean"] = (torch.randn(z_dim, generator=g) * 0.5).tolist()
        extra["latents_std"] = (torch.rand(z_dim, generator=g) + 0.5).tolist()
    return AutoencoderKLWan(base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1, **extra)


def build_tiny_wan_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    shift: float = 3.0,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random ``WanPipeline`` (Wan 2.1 text-to-video), saved to ``path`` if given.

    UMT5 encoder (d_model 32), ``WanTransformer3DModel`` (patch (1, 2, 2), 2 heads x 12, 2
    layers, text_dim 32), ``AutoencoderKLWan`` (base_dim 8, z_dim 16: 4x temporal and 8x spatial
    compression), ``FlowMatchEulerDiscreteScheduler(shift=shift)`` (the released Wan 2.1 uses
    UniPC with the same ``flow_shift``; the Euler scheduler lets tests compare step by step).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _wan_transformer()
        text_encoder = t5_encoder(32, umt5=True)
        vae = _wan_vae()
    pipe = WanPipeline(
        tokenizer=_wan_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    return finish(pipe, path, torch_dtype)


def _two_expert_wan(pipeline_class: Any, in_channels: int, boundary_ratio: float, shift: float, seed: int) -> Any:
    """A tiny Wan 2.2 A14B-style pipeline: two experts like :func:`build_tiny_wan_pipeline`'s
    transformer, each with its own weights, switching at ``boundary_ratio``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer, transformer_2 = _wan_transformer(in_channels), _wan_transformer(in_channels)
        text_encoder = t5_encoder(32, umt5=True)
        vae = _wan_vae()
    return pipeline_class(
        tokenizer=_wan_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        transformer_2=transformer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        boundary_ratio=boundary_ratio,
    )


def build_tiny_wan22_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    boundary_ratio: float = 0.875,
    shift: float = 3.0,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random Wan 2.2 T2V-A14B ``WanPipeline``: two experts (``transformer`` for timesteps
    >= ``boundary_ratio`` x 1000, ``transformer_2`` below; 0.875 as the released T2V-A14B); saved to
    ``path`` if given."""
    from diffusers import WanPipeline

    return finish(_two_expert_wan(WanPipeline, 16, boundary_ratio, shift, seed), path, torch_dtype)


def build_tiny_wan22_i2v_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    boundary_ratio: float = 0.9,
    shift: float = 3.0,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random Wan 2.2 I2V-A14B ``WanImageToVideoPipeline``: two experts with 36 input
    channels (16 latent + 4 first-frame mask + 16 image latents), no CLIP image encoder,
    ``boundary_ratio`` 0.9 as the released I2V-A14B; saved to ``path`` if given."""
    from diffusers import WanImageToVideoPipeline

    return finish(_two_expert_wan(WanImageToVideoPipeline, 36, boundary_ratio, shift, seed), path, torch_dtype)


def build_tiny_wan22_ti2v_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    shift: float = 5.0,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random Wan 2.2 TI2V-5B ``WanPipeline`` (text-to-video): one transformer with 48
    channels, the Wan 2.2 VAE (:data:`WAN22_VAE`, 16x spatial), timesteps per token
    (``expand_timesteps``); saved to ``path`` if given. 32x32 videos are 2x2 latents: pass 64."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _wan_transformer(48, 48)
        text_encoder = t5_encoder(32, umt5=True)
        vae = _wan_vae(**WAN22_VAE)
    pipe = WanPipeline(
        tokenizer=_wan_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        expand_timesteps=True,
    )
    return finish(pipe, path, torch_dtype)
