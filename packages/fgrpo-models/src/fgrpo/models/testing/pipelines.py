"""Tiny random diffusers pipelines built offline, for tests, tools and plugin authors.

Nothing is downloaded: tokenizers are built from in-memory vocabularies and every network is a
freshly initialised miniature of the real architecture, with the real configurations where they
matter (schedulers, VAE latent normalisation, the Qwen-Image prompt template's token count). Each
builder returns a real pipeline that runs ``pipe(...)``, and saves it with ``save_pretrained`` when
given a path, so a test loads it through the same ``from_pretrained`` path users take:

- :func:`build_tiny_sd3_pipeline` -> ``StableDiffusion3Pipeline`` (CLIP x2 + T5, SD3 transformer)
- :func:`build_tiny_flux_pipeline` -> ``FluxPipeline`` (CLIP + T5, guidance-distilled transformer)
- :func:`build_tiny_qwen_image_pipeline` -> ``QwenImagePipeline`` (Qwen2.5-VL text encoder)
- :func:`build_tiny_flux_kontext_pipeline` -> ``FluxKontextPipeline`` (FLUX's networks, a source image)
- :func:`build_tiny_qwen_image_edit_pipeline` -> ``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline``
  (the VL encoder sees the source images through a Qwen2-VL processor)
- :func:`build_tiny_wan_pipeline` -> ``WanPipeline`` (UMT5, Wan 2.1 text-to-video transformer)
- :func:`build_tiny_flux2_pipeline`, :func:`build_tiny_flux2_klein_pipeline` -> FLUX.2 [dev] / [klein]
- :func:`build_tiny_z_image_pipeline` -> ``ZImagePipeline`` (Qwen3)
- :func:`build_tiny_wan22_pipeline`, :func:`build_tiny_wan22_i2v_pipeline`,
  :func:`build_tiny_wan22_ti2v_pipeline` -> Wan 2.2 T2V-A14B (two experts), I2V-A14B, TI2V-5B
- :func:`build_tiny_hunyuan_video15_pipeline` -> ``HunyuanVideo15Pipeline`` (Qwen2.5-VL + ByT5)

About 1-3 MB each; 64x64 outputs by default (Wan: 5 frames of 32x32).
diffusers and transformers are imported inside the builders, so importing this module is cheap.
"""

from __future__ import annotations

import inspect
import os
import string
import tempfile
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch

#: The real SD3 VAE's latent normalisation, so tests exercise scaling *and* shift.
SD3_VAE_SCALING_FACTOR = 1.5305
SD3_VAE_SHIFT_FACTOR = 0.0609
#: FLUX.1's VAE normalisation and scheduler (resolution-dependent shift)
FLUX_VAE_SCALING_FACTOR = 0.3611
FLUX_VAE_SHIFT_FACTOR = 0.1159
FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
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


def _bytes_to_unicode() -> dict[int, str]:
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


def tiny_qwen_tokenizer() -> Any:
    """A byte-level ``Qwen2Tokenizer`` whose merges make each word of the Qwen-Image prompt template
    one token, so the template's prefix is 34 tokens as with the real tokenizer (the pipeline drops
    exactly that many); other text is mostly one token per byte. 367 tokens."""
    import re

    from transformers import Qwen2Tokenizer

    table = _bytes_to_unicode()
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


def _clip_config(**overrides: Any) -> Any:
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


def _t5_encoder(d_model: int, *, umt5: bool = False) -> Any:
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


def _kl_vae(blocks: Sequence[int], latent_channels: int, sample_size: int, scaling: float, shift: float) -> Any:
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


# STRICT_CONFIGS: transformers' @strict dataclass configs take keys beyond their fields through
# __post_init__(**kwargs); the dataclass signature mypy sees omits them, hence the call-arg ignores.


# The networks handed to _randomise are imported from their own modules: mypy reads diffusers'
# top-level names as its dummy objects, which are no torch.nn.Module.
def _randomise(module: torch.nn.Module, std: float = 0.05) -> None:
    """Every weight random (diffusers zero-initialises output projections and modulation gates,
    which would make a tiny transformer's output ignore its inputs)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ("norm" in name and name.endswith("weight")):
                p.fill_(1.0)  # keep norms at unit gain
            else:
                p.normal_(0.0, std)


def _finish(pipe: Any, path: str | os.PathLike[str] | None, torch_dtype: torch.dtype) -> Any:
    pipe.set_progress_bar_config(disable=True)
    if torch_dtype != torch.float32:
        pipe.to(dtype=torch_dtype)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    if path is not None:
        pipe.save_pretrained(os.fspath(path))
    return pipe


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
        text_encoder = CLIPTextModelWithProjection(_clip_config())
        text_encoder_2 = CLIPTextModelWithProjection(_clip_config())
        text_encoder_3 = _t5_encoder(64)
        vae = _kl_vae(blocks, 16, sample_size * 2 ** (len(blocks) - 1), SD3_VAE_SCALING_FACTOR, SD3_VAE_SHIFT_FACTOR)
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
    return _finish(pipe, path, torch_dtype)


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
        _randomise(transformer)
        text_encoder = CLIPTextModel(_clip_config())
        text_encoder_2 = _t5_encoder(64)
        vae = _kl_vae((8, 16, 16, 16), 16, 64, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR)
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
    return _finish(pipe, path, torch_dtype)


def build_tiny_flux_kontext_pipeline(path: str | os.PathLike[str] | None = None, **options: Any) -> Any:
    """A tiny random ``FluxKontextPipeline`` (FLUX.1 Kontext [dev]'s structure; the networks of
    :func:`build_tiny_flux_pipeline`), saved to ``path`` if given."""
    return build_tiny_flux_pipeline(path, pipeline_class="FluxKontextPipeline", **options)


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
        _randomise(transformer)
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
    return _finish(pipe, path, torch_dtype)


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

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
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
    import fgrpo.models.testing.pipelines as this

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
    return _finish(pipe, path, torch_dtype)


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
    _randomise(transformer)
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
        text_encoder = _t5_encoder(32, umt5=True)
        vae = _wan_vae()
    pipe = WanPipeline(
        tokenizer=_wan_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    return _finish(pipe, path, torch_dtype)


def _two_expert_wan(pipeline_class: Any, in_channels: int, boundary_ratio: float, shift: float, seed: int) -> Any:
    """A tiny Wan 2.2 A14B-style pipeline: two experts like :func:`build_tiny_wan_pipeline`'s
    transformer, each with its own weights, switching at ``boundary_ratio``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer, transformer_2 = _wan_transformer(in_channels), _wan_transformer(in_channels)
        text_encoder = _t5_encoder(32, umt5=True)
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

    return _finish(_two_expert_wan(WanPipeline, 16, boundary_ratio, shift, seed), path, torch_dtype)


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

    return _finish(_two_expert_wan(WanImageToVideoPipeline, 36, boundary_ratio, shift, seed), path, torch_dtype)


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
        text_encoder = _t5_encoder(32, umt5=True)
        vae = _wan_vae(**WAN22_VAE)
    pipe = WanPipeline(
        tokenizer=_wan_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        expand_timesteps=True,
    )
    return _finish(pipe, path, torch_dtype)


# --- chat-template tokenizers of the current text encoders (Mistral 3, Qwen3) -----------------

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
#: Qwen3's chat format for the turns the pipelines render (a user message and the generation
#: prompt; ``enable_thinking=False`` adds the empty think block, as Qwen3's own template does)
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is "
    "false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_byte_tokenizer(specials: Sequence[str], chat_template: str | None = None, **named: str) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` without merges (every byte a token) plus
    ``specials``, with ``chat_template``; ``named`` maps bos/eos/pad/unk_token to specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    for special in specials:
        vocab[special] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    others = [s for s in specials if s not in set(named.values())]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, additional_special_tokens=others, chat_template=chat_template, **named
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


def tiny_qwen3_tokenizer() -> Any:
    """Qwen3's special tokens and chat format (FLUX.2 [klein], Z-Image)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    return tiny_byte_tokenizer(specials, QWEN3_CHAT_TEMPLATE, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def _qwen3_config(tokenizer: Any, layers: int = 2) -> Any:
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
    _randomise(transformer)
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
    return _finish(pipe, path, torch_dtype)


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
        text_encoder = Qwen3ForCausalLM(_qwen3_config(tokenizer))
        transformer, vae = _flux2_parts(guidance_embeds=False, text_hidden=16)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=is_distilled,
    )
    return _finish(pipe, path, torch_dtype)


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
        text_encoder = Qwen3Model(_qwen3_config(tokenizer))
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
        _randomise(transformer)
        vae = _kl_vae((8, 16, 16, 16), 16, 64, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR)
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    return _finish(pipe, path, torch_dtype)


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
        _randomise(transformer)
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
    return _finish(pipe, path, torch_dtype)


__all__ = [
    "QWEN_IMAGE_TEMPLATE",
    "build_tiny_flux2_klein_pipeline",
    "build_tiny_flux2_pipeline",
    "build_tiny_flux_pipeline",
    "build_tiny_hunyuan_video15_pipeline",
    "build_tiny_qwen_image_pipeline",
    "build_tiny_sd3_pipeline",
    "build_tiny_wan22_i2v_pipeline",
    "build_tiny_wan22_pipeline",
    "build_tiny_wan22_ti2v_pipeline",
    "build_tiny_wan_pipeline",
    "build_tiny_z_image_pipeline",
    "tiny_byte_tokenizer",
    "tiny_clip_tokenizer",
    "tiny_hunyuan_video15_tokenizer",
    "tiny_mistral_tokenizer",
    "tiny_qwen3_tokenizer",
    "tiny_qwen_tokenizer",
    "tiny_t5_tokenizer",
]
