"""A tiny ``HunyuanVideo15Pipeline`` (Qwen2.5-VL + ByT5)."""

from __future__ import annotations

import inspect
import os
from itertools import pairwise
from typing import Any

import torch

from fgrpo.models.testing.pipelines._common import finish, randomise, tiny_byte_tokenizer

#: Qwen2.5-VL's chat format for the turns HunyuanVideo 1.5 renders (system, user, generation prompt)
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_hunyuan_video15_tokenizer(system_message: str, template_tokens: int = 108) -> Any:
    """A byte-level Qwen-style tokenizer whose rendering of HunyuanVideo 1.5's chat template puts
    exactly ``template_tokens`` tokens before the prompt, as the real tokenizer does (the pipeline
    crops its fixed ``prompt_template_encode_start_idx`` = 108): the system message is cut into
    added tokens so that ``<|im_start|>system\n`` + message + ``<|im_end|>\n<|im_start|>user\n``
    comes to that count."""

    def build(pieces: int) -> Any:
        cuts = [len(system_message) * i // pieces for i in range(pieces + 1)]
        tokenizer = tiny_byte_tokenizer(
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            QWEN_CHAT_TEMPLATE,
            pad_token="<|endoftext|>",
            eos_token="<|im_end|>",
        )
        tokenizer.add_tokens([system_message[a:b] for a, b in pairwise(cuts)])
        return tokenizer

    def prefix(tokenizer: Any) -> int:  # tokens before the prompt "~"
        messages = [{"role": "system", "content": system_message}, {"role": "user", "content": "~"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        return list(ids).index(tokenizer.convert_tokens_to_ids("~"))

    pieces = template_tokens - (1 + len("system\n") + 1 + 1 + 1 + len("user\n"))
    for tried in sorted(range(pieces - 30, pieces + 1), key=lambda n: abs(n - pieces)):
        tokenizer = build(tried)  # a piece may also match inside the template's other words: measure
        if prefix(tokenizer) == template_tokens:
            return tokenizer
    raise ValueError(f"could not cut the system message so that the template is {template_tokens} tokens")
    return tokenizer


def build_tiny_hunyuan_video15_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    guidance_scale: float = 6.0,
    shift: float = 5.0,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random ``HunyuanVideo15Pipeline`` (text-to-video), saved to ``path`` if given.

    Text encoders: a 3-layer ``Qwen2_5_VLTextModel`` (hidden 16, mrope) behind
    :func:`tiny_hunyuan_video15_tokenizer` (the template's 108 tokens cropped as with the real
    one), and a 1-layer ByT5 ``T5EncoderModel`` for quoted glyph text. Transformer:
    ``HunyuanVideo15Transformer3DModel`` (1 block + 1 refiner layer, 2 heads x 16, 65 input
    channels = 32 latent + 32 condition + 1 mask). VAE: ``AutoencoderKLHunyuanVideo15`` (32
    channels, 16x spatial and 4x temporal compression). Guider: ``ClassifierFreeGuidance``.
    The pipeline's text widths (``tokenizer_max_length`` 1000, ByT5's 256) are pipeline
    attributes: the backbone's ``max_sequence_length``/``glyph_sequence_length`` set them.
    """
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
    )
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15Transformer3DModel
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    # the pipeline's own system message and crop (instance attributes its encoder's defaults repeat)
    defaults = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    byt5 = ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=65,
            out_channels=32,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=1,
            num_refiner_layers=1,
            text_embed_dim=16,
            text_embed_2_dim=16,
            image_embed_dim=16,
            rope_axes_dim=(4, 6, 6),
            target_size=64,
            task_type="t2v",
        )
        randomise(transformer)
        vae = AutoencoderKLHunyuanVideo15(
            latent_channels=32, block_out_channels=(8, 16, 32, 32, 32), layers_per_block=1
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(  # type: ignore[call-arg]  # extra keys: see STRICT_CONFIGS
                vocab_size=len(byt5),
                d_model=16,
                d_kv=4,
                d_ff=32,
                num_layers=1,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            )
        )
        tokenizer = tiny_hunyuan_video15_tokenizer(defaults["system_message"].default, defaults["crop_start"].default)
        text_encoder = Qwen2_5_VLTextModel(
            Qwen2_5_VLTextConfig(  # type: ignore[call-arg]  # extra keys: see STRICT_CONFIGS
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=2048,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2], "rope_type": "default"},
                vocab_size=len(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id,
            )
        )
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        text_encoder_2=text_encoder_2,
        tokenizer_2=byt5,
        guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
    )
    return finish(pipe, path, torch_dtype)
