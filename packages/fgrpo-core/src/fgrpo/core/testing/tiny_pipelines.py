"""Tiny random diffusers pipelines built offline, for tests and tools.

Nothing is downloaded: the tokenizers are built from in-memory vocabularies (a byte-level CLIP
BPE vocabulary without merges, a character-level T5 unigram vocabulary) and every network is a
freshly initialised miniature of the real architecture. The result is a real
``StableDiffusion3Pipeline``: it runs ``pipe(...)``, saves with ``save_pretrained`` and reloads
with ``from_pretrained`` under ``HF_HUB_OFFLINE=1``.

diffusers and transformers are imported inside the builders, so importing this module is cheap.
"""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from typing import Any

import torch

#: The real SD3 VAE's latent normalisation, so tests exercise scaling *and* shift.
SD3_VAE_SCALING_FACTOR = 1.5305
SD3_VAE_SHIFT_FACTOR = 0.0609


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (CLIP's BPE alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_clip_tokenizer(model_max_length: int = 77) -> Any:
    """A byte-level ``CLIPTokenizer`` without merges (every character is a token); 514 tokens."""
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def tiny_t5_tokenizer() -> Any:
    """A character-level T5 (unigram) tokenizer: <pad>, </s>, <unk>, '▁' and printable ASCII."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


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
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    patch_size = 2
    latent_channels = 16
    blocks = tuple(int(c) for c in vae_block_out_channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=sample_size,
            patch_size=patch_size,
            in_channels=latent_channels,
            out_channels=latent_channels,
            num_layers=num_layers,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=64,
            pooled_projection_dim=64,
            pos_embed_max_size=max(16, sample_size // patch_size),
            **({"qk_norm": "rms_norm", "dual_attention_layers": (0,)} if sd35 else {}),
        )
        clip_config = CLIPTextConfig(
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
            hidden_size=32,
            intermediate_size=37,
            layer_norm_eps=1e-5,
            num_attention_heads=4,
            num_hidden_layers=2,
            projection_dim=32,
            vocab_size=514,
            max_position_embeddings=77,
            hidden_act="gelu",
        )
        text_encoder = CLIPTextModelWithProjection(clip_config)
        text_encoder_2 = CLIPTextModelWithProjection(clip_config)
        t5_config = T5Config(
            vocab_size=98,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
        text_encoder_3 = T5EncoderModel(t5_config)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * len(blocks),
            up_block_types=("UpDecoderBlock2D",) * len(blocks),
            block_out_channels=blocks,
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=min(8, min(blocks)),
            sample_size=sample_size * 2 ** (len(blocks) - 1),
            scaling_factor=SD3_VAE_SCALING_FACTOR,
            shift_factor=SD3_VAE_SHIFT_FACTOR,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
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
    pipe.set_progress_bar_config(disable=True)
    if torch_dtype != torch.float32:
        pipe.to(dtype=torch_dtype)
    for module in (transformer, text_encoder, text_encoder_2, text_encoder_3, vae):
        module.eval()
    if path is not None:
        pipe.save_pretrained(os.fspath(path))
    return pipe
