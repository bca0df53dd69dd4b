"""Tiny ``QwenImagePipeline`` (Qwen2.5-VL text encoder) and ``QwenImageEditPipeline`` /
``QwenImageEditPlusPipeline`` (the VL encoder sees the source images through a Qwen2-VL processor)."""

from __future__ import annotations

import os
from typing import Any

import torch

from fgrpo.models.testing.pipelines._common import bytes_to_unicode, finish, randomise

#: Qwen-Image's scheduler: exponential resolution-dependent shift, stretched to a terminal sigma
QWEN_IMAGE_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


#: Qwen-Image's prompt template (the pipeline's ``prompt_template_encode``); its part before the
#: prompt is 34 tokens with the real tokenizer, the pipeline's ``prompt_template_encode_start_idx``
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def tiny_qwen_tokenizer() -> Any:
    """A byte-level ``Qwen2Tokenizer`` whose merges make each word of the Qwen-Image prompt template
    one token, so the template's prefix is 34 tokens as with the real tokenizer (the pipeline drops
    exactly that many); other text is mostly one token per byte. 367 tokens."""
    import re

    from transformers import Qwen2Tokenizer

    table = bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(table.values())}
    merges: list[tuple[str, str]] = []
    plain = QWEN_IMAGE_TEMPLATE.replace("<|im_start|>", "\n").replace("<|im_end|>", "\n")
    words = sorted({"".join(table[b] for b in w.encode()) for w in re.findall(r" ?[A-Za-z]+", plain)})
    for word in words:
        built = word[0]
        for char in word[1:]:
            if (built, char) not in merges:
                merges.append((built, char))
            built += char
            vocab.setdefault(built, len(vocab))
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # (a, b) pairs, which tokenizers' BPE takes; annotated as str
        unk_token=None,  # type: ignore[arg-type]  # no unknown token (every byte has one); annotated as str
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )


def _tiny_qwen_networks(tokenizer: Any, seed: int, **vl_config: Any) -> tuple[Any, Any, Any]:
    """(transformer, Qwen2.5-VL text encoder, VAE) of the tiny Qwen-Image pipelines."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
        randomise(transformer)
        config = Qwen2_5_VLConfig(  # type: ignore[call-arg]  # extra keys: see STRICT_CONFIGS
            text_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "vocab_size": len(tokenizer),
                "max_position_embeddings": 1024,
                "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4], "rope_type": "default"},
                "rope_theta": 1000000.0,
            },
            vision_config={
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 32,
                "num_heads": 2,
                "out_hidden_size": 32,
            },
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **vl_config,
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration(config)
        vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    return transformer, text_encoder, vae


def build_tiny_qwen_image_pipeline(
    path: str | os.PathLike[str] | None = None, *, seed: int = 0, torch_dtype: torch.dtype = torch.float32
) -> Any:
    """A tiny random ``QwenImagePipeline``, saved to ``path`` if given.

    Text encoder: ``Qwen2_5_VLForConditionalGeneration`` with a 2-layer text model (hidden 32,
    mrope sections [2, 2, 4]) and a 1-layer vision tower; tokenizer: :func:`tiny_qwen_tokenizer`
    (the template prefix is 34 tokens, as the pipeline assumes). Transformer: 2 blocks, 4 heads x
    16, joint_attention_dim 32, patch 2 (in_channels 64 = 4 x 16). VAE: ``AutoencoderKLQwenImage``
    (base_dim 8, z_dim 16, the real per-channel latent mean and std). Qwen-Image's scheduler.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    tokenizer = tiny_qwen_tokenizer()
    transformer, text_encoder, vae = _tiny_qwen_networks(tokenizer, seed)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return finish(pipe, path, torch_dtype)


#: The system part of Qwen-Image-Edit's prompt template (both pipelines'); with "<|im_start|>user\n"
#: after it, 64 tokens with the real tokenizer: the pipelines' ``prompt_template_encode_start_idx``
QWEN_IMAGE_EDIT_SYSTEM = (
    "system\nDescribe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets the "
    "user's requirements while maintaining consistency with the original input where appropriate."
)


QWEN_IMAGE_EDIT_PREFIX_TOKENS = 64


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def tiny_qwen_edit_tokenizer() -> Any:
    """A byte-level ``Qwen2Tokenizer`` (every other byte is a token) whose added tokens make most
    words of the Qwen-Image-Edit template's system text one token each, so that its prefix up to
    ``<|im_start|>user\n`` is 64 tokens as with the real tokenizer (the edit pipelines drop exactly
    that many); with the vision tokens the Qwen2-VL processor expands (``<|image_pad|>``)."""
    import itertools

    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *VISION_TOKENS)
    for special in specials:
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,  # type: ignore[arg-type]  # no unknown token (every byte has one); annotated as str
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(specials[1:]),
    )
    pieces = [QWEN_IMAGE_EDIT_SYSTEM[:7]] + [" " + w for w in QWEN_IMAGE_EDIT_SYSTEM[7:].split(" ")]
    pieces[1] = pieces[1][1:]  # "Describe" follows the newline without a space
    fixed = 9  # <|im_start|> ... <|im_end|> \n <|im_start|> u s e r \n
    missing = QWEN_IMAGE_EDIT_PREFIX_TOKENS - fixed - len(pieces)
    # words left as bytes make up the difference: a word of n bytes is n tokens instead of 1
    once = [w for w in pieces[2:] if pieces.count(w) == 1 and w[1:].isalpha()]
    bytewise = next(
        set(c) for k in range(1, 5) for c in itertools.combinations(once, k) if sum(len(w) - 1 for w in c) == missing
    )
    tokenizer.add_tokens(
        [
            AddedToken(piece, normalized=False, special=False)
            for piece in dict.fromkeys(pieces)
            if piece not in bytewise
        ]
    )
    prefix = "<|im_start|>" + QWEN_IMAGE_EDIT_SYSTEM + "<|im_end|>\n<|im_start|>user\n"
    count = len(tokenizer(prefix).input_ids)
    if count != QWEN_IMAGE_EDIT_PREFIX_TOKENS:  # pragma: no cover - a tokenizers change would show here
        raise RuntimeError(f"the tiny Qwen-Image-Edit tokenizer makes the template prefix {count} tokens, not 64")
    return tokenizer


def _image_only_processor_class() -> Any:
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor without a video processor: transformers 5 builds its
        ``Qwen2VLVideoProcessor`` with torchvision only, which the CPU test machines lack (a torchvision
        wheel built for another torch cannot load its operators). Images and text are processed
        exactly as by ``Qwen2VLProcessor``; it saves and loads with the pipeline
        (``model_index.json`` names this module)."""

        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
        ):
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            super(Qwen2VLProcessor, self).__init__(image_processor, tokenizer, chat_template=chat_template)

    ImageOnlyQwen2VLProcessor.__module__ = __name__
    ImageOnlyQwen2VLProcessor.__qualname__ = "ImageOnlyQwen2VLProcessor"
    return ImageOnlyQwen2VLProcessor


#: names this module makes on first use (``__getattr__``)
LAZY = ("ImageOnlyQwen2VLProcessor",)


def __getattr__(name: str) -> Any:
    # the processor class is built on first use (importing this module stays free of transformers);
    # diffusers, loading a component of a module outside its known libraries, looks the base classes
    # it knows how to load (ProcessorMixin) up in that module
    if name == "ImageOnlyQwen2VLProcessor":
        globals()[name] = _image_only_processor_class()
        return globals()[name]
    if name == "ProcessorMixin":
        from transformers import ProcessorMixin

        return ProcessorMixin
    raise AttributeError(name)


def build_tiny_qwen_image_edit_pipeline(
    path: str | os.PathLike[str] | None = None,
    *,
    plus: bool = False,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
) -> Any:
    """A tiny random ``QwenImageEditPipeline`` (``plus``: ``QwenImageEditPlusPipeline``, 2509's
    several source images), saved to ``path`` if given: the networks of
    :func:`build_tiny_qwen_image_pipeline`, a tokenizer whose template prefix is the real 64 tokens
    (:func:`tiny_qwen_edit_tokenizer`), and a Qwen2-VL processor whose image processor keeps the
    vision tower's input small (16 to 64 patches of 14 px; Qwen2.5-VL's patch and merge sizes)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    ImageProcessor: Any
    try:  # transformers >= 5 without torchvision: the PIL image processor (what Qwen2VLImageProcessor falls back to)
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:  # pragma: no cover
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    tokenizer = tiny_qwen_edit_tokenizer()
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in (
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
        )
    }
    transformer, text_encoder, vae = _tiny_qwen_networks(tokenizer, seed, **ids)
    image_processor = ImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    import fgrpo.models.testing.pipelines.qwen_image as this  # the class is made on first use (__getattr__)

    processor = this.ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    name = "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline"
    pipe = getattr(diffusers, name)(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )
    return finish(pipe, path, torch_dtype)
