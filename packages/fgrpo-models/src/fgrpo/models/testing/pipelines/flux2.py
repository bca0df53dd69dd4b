"""Tiny FLUX.2 [dev] (Mistral 3 text encoder) and [klein] (Qwen3) pipelines."""

from __future__ import annotations

import os
from typing import Any

import torch

from fgrpo.models.testing.pipelines._common import (
    finish,
    qwen3_config,
    randomise,
    tiny_byte_tokenizer,
    tiny_qwen3_tokenizer,
)

#: Mistral's chat format as FLUX.2's processor renders the pipeline's messages (content parts of
#: type "text" joined; a system message in [SYSTEM_PROMPT], a user turn in [INST])
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['content'] is string %}{% set text = m['content'] %}{% else %}"
    "{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}{% endif "
    "%}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]{{ "
    "text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def tiny_mistral_tokenizer() -> Any:
    """Mistral's special tokens and chat format (FLUX.2 [dev] uses a Pixtral processor, whose
    ``apply_chat_template`` the pipeline calls; a tokenizer takes the same call)."""
    specials = [
        "<unk>",
        "<s>",
        "</s>",
        "<pad>",
        "[INST]",
        "[/INST]",
        "[SYSTEM_PROMPT]",
        "[/SYSTEM_PROMPT]",
        "[IMG]",
        "[IMG_BREAK]",
        "[IMG_END]",
    ]
    return tiny_byte_tokenizer(
        specials, MISTRAL_CHAT_TEMPLATE, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


#: FLUX.2's scheduler: the exponential time shift, by an ``mu`` the pipeline computes itself
FLUX2_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


def _flux2_parts(guidance_embeds: bool, text_hidden: int, layers_stacked: int = 3) -> tuple[Any, Any]:
    """A tiny ``Flux2Transformer2DModel`` (1 double + 1 single block, 2 heads x 16, rope (4, 4, 4, 4),
    128 input channels = 4 x 32 VAE channels) and ``AutoencoderKLFlux2`` (scale 8, 32 channels,
    random batch-norm statistics so that decoding exercises them)."""
    from diffusers.models.autoencoders.autoencoder_kl_flux2 import AutoencoderKLFlux2
    from diffusers.models.transformers.transformer_flux2 import Flux2Transformer2DModel

    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=layers_stacked * text_hidden,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )
    randomise(transformer)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=32, norm_num_groups=8, sample_size=64
    )
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return transformer, vae


def build_tiny_flux2_pipeline(
    path: str | os.PathLike[str] | None = None, *, seed: int = 0, torch_dtype: torch.dtype = torch.float32
) -> Any:
    """A tiny random ``Flux2Pipeline`` (FLUX.2 [dev]: Mistral 3 text encoder, guidance embedding),
    saved to ``path`` if given.

    Text encoder: ``Mistral3ForConditionalGeneration`` (2-layer Mistral text model, hidden 16, and a
    1-layer Pixtral vision tower); the pipeline stacks three hidden layers, so pass
    ``text_encoder_out_layers=(1, 2, 2)`` (the real default (10, 20, 30) needs 30 layers).
    Tokenizer: :func:`tiny_mistral_tokenizer`. Transformer and VAE: :func:`_flux2_parts`.
    64x64 images are 4x4 tokens; the pipeline's default side stays 1024: pass height/width.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = tiny_mistral_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = Mistral3Config(
            text_config={
                "model_type": "mistral",
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "vocab_size": len(tokenizer),
                "max_position_embeddings": 512,
                "pad_token_id": tokenizer.pad_token_id,
            },
            vision_config={
                "model_type": "pixtral",
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "head_dim": 8,
                "image_size": 32,
                "patch_size": 8,
            },
            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        )
        text_encoder = Mistral3ForConditionalGeneration(config)
        transformer, vae = _flux2_parts(guidance_embeds=True, text_hidden=16)
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return finish(pipe, path, torch_dtype)


def build_tiny_flux2_klein_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    is_distilled: bool = False,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random ``Flux2KleinPipeline`` (FLUX.2 [klein] base: Qwen3 text encoder, true CFG, no
    guidance embedding), saved to ``path`` if given. ``is_distilled``: the step-distilled variant
    (guidance ignored). Text encoder: a 2-layer ``Qwen3ForCausalLM`` (hidden 16): pass
    ``text_encoder_out_layers=(1, 2, 2)``. Transformer and VAE: :func:`_flux2_parts`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    tokenizer = tiny_qwen3_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(qwen3_config(tokenizer))
        transformer, vae = _flux2_parts(guidance_embeds=False, text_hidden=16)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=is_distilled,
    )
    return finish(pipe, path, torch_dtype)
