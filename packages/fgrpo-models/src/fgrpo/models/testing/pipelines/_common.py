"""Offline building blocks the tiny pipelines share: byte-level tokenizers built from in-memory
vocabularies, miniature CLIP/T5/Qwen3 text encoders, VAEs, and saving a pipeline."""

from __future__ import annotations

import os
import string
from collections.abc import Sequence
from typing import Any

import torch

#: The real SD3 VAE's latent normalisation, so tests exercise scaling *and* shift.
SD3_VAE_SCALING_FACTOR = 1.5305


SD3_VAE_SHIFT_FACTOR = 0.0609


#: FLUX.1's VAE normalisation and scheduler (resolution-dependent shift)
FLUX_VAE_SCALING_FACTOR = 0.3611


FLUX_VAE_SHIFT_FACTOR = 0.1159


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (CLIP's BPE alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def tiny_clip_tokenizer(model_max_length: int = 77) -> Any:
    """A byte-level ``CLIPTokenizer`` without merges (every character is a token); 514 tokens."""
    from transformers import CLIPTokenizer

    chars = list(bytes_to_unicode().values())
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


def clip_config(**overrides: Any) -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        **{
            "bos_token_id": 512,
            "eos_token_id": 513,
            "pad_token_id": 513,
            "hidden_size": 32,
            "intermediate_size": 37,
            "layer_norm_eps": 1e-5,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "projection_dim": 32,
            "vocab_size": 514,
            "max_position_embeddings": 77,
            "hidden_act": "gelu",
            **overrides,
        }
    )


def t5_encoder(d_model: int, *, umt5: bool = False) -> Any:
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    keys: dict[str, Any] = dict(
        vocab_size=98,
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(UMT5Config(**keys)) if umt5 else T5EncoderModel(T5Config(**keys))


def kl_vae(blocks: Sequence[int], latent_channels: int, sample_size: int, scaling: float, shift: float) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(blocks),
        up_block_types=("UpDecoderBlock2D",) * len(blocks),
        block_out_channels=tuple(blocks),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=min(8, min(blocks)),
        sample_size=sample_size,
        scaling_factor=scaling,
        shift_factor=shift,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def randomise(module: torch.nn.Module, std: float = 0.05) -> None:
    """Every weight random (diffusers zero-initialises output projections and modulation gates,
    which would make a tiny transformer's output ignore its inputs)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ("norm" in name and name.endswith("weight")):
                p.fill_(1.0)  # keep norms at unit gain
            else:
                p.normal_(0.0, std)


def finish(pipe: Any, path: str | os.PathLike[str] | None, torch_dtype: torch.dtype) -> Any:
    pipe.set_progress_bar_config(disable=True)
    if torch_dtype != torch.float32:
        pipe.to(dtype=torch_dtype)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    if path is not None:
        pipe.save_pretrained(os.fspath(path))
    return pipe


def tiny_byte_tokenizer(specials: Sequence[str], chat_template: str | None = None, **named: str) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` without merges (every byte a token) plus
    ``specials``, with ``chat_template``; ``named`` maps bos/eos/pad/unk_token to specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for special in specials:
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    others = [s for s in specials if s not in set(named.values())]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, additional_special_tokens=others, chat_template=chat_template, **named
    )


#: Qwen3's chat format for the turns the pipelines render (a user message and the generation
#: prompt; ``enable_thinking=False`` adds the empty think block, as Qwen3's own template does)
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is "
    "false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_qwen3_tokenizer() -> Any:
    """Qwen3's special tokens and chat format (FLUX.2 [klein], Z-Image)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    return tiny_byte_tokenizer(specials, QWEN3_CHAT_TEMPLATE, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def qwen3_config(tokenizer: Any, layers: int = 2) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
