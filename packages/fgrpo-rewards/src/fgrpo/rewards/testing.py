"""Tiny random reward models written to a folder, for offline tests and benchmarks.

They exercise the same loading code users use (``path: <folder>``): a 2-layer CLIP with a
byte-level tokenizer and processor, saved with ``save_pretrained``. Needs transformers.
"""

from __future__ import annotations

from pathlib import Path

import torch


def byte_characters() -> list[str]:
    """The 256 characters of GPT-2's byte-level alphabet (CLIP's BPE uses the same)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def clip_tokenizer(max_length: int = 77):
    """A CLIPTokenizer over single bytes (no merges): every prompt tokenises, nothing downloads."""
    from transformers import CLIPTokenizer

    chars = byte_characters()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_clip_config(projection_dim: int = 16, hidden: int = 32, image_size: int = 32, hidden_act: str = "quick_gelu"):
    from transformers import CLIPConfig

    tokenizer = clip_tokenizer()
    vocab = tokenizer.get_vocab()
    text = dict(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=projection_dim,
        hidden_act=hidden_act,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    vision = dict(
        hidden_size=hidden,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=8,
        projection_dim=projection_dim,
        hidden_act=hidden_act,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)


def save_tiny_clip(
    folder: str | Path,
    *,
    seed: int = 0,
    projection_dim: int = 16,
    image_size: int = 32,
    hidden_act: str = "quick_gelu",
) -> Path:
    """A random 2-layer CLIP (hidden 32, ``image_size`` square images), its byte-level tokenizer
    and processor (resize shortest edge, centre crop), saved to ``folder``."""
    from transformers import CLIPImageProcessor, CLIPModel

    folder = Path(folder)
    torch.manual_seed(seed)
    model = CLIPModel(tiny_clip_config(projection_dim, image_size=image_size, hidden_act=hidden_act))
    model.save_pretrained(folder)
    clip_tokenizer().save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    ).save_pretrained(folder)
    return folder


def save_tiny_dinov2(folder: str | Path, *, seed: int = 0, image_size: int = 32) -> Path:
    """A random 2-layer DINOv2 (hidden 32, patch 8) and its image processor (resize the shortest
    edge, centre crop, ImageNet mean/std, as facebook/dinov2-* configure it), saved to ``folder``."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    folder = Path(folder)
    torch.manual_seed(seed)
    # transformers' @strict dataclass configs take keys beyond their fields through
    # __post_init__(**kwargs); the dataclass signature mypy sees omits them
    config = Dinov2Config(  # type: ignore[call-arg]
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        patch_size=8,
        image_size=image_size,
    )
    Dinov2Model(config).save_pretrained(folder)
    BitImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_convert_rgb=True,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
        resample=3,
    ).save_pretrained(folder)
    return folder


def save_tiny_owlv2(folder: str | Path, *, seed: int = 0, image_size: int = 32) -> Path:
    """A random 2-layer OWLv2 detector (32x32 inputs, patch 8) with a byte-level tokenizer."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    folder = Path(folder)
    tokenizer = clip_tokenizer(max_length=16)
    vocab = tokenizer.get_vocab()
    text = dict(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=8,
    )
    torch.manual_seed(seed)
    model = Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=32))
    model.save_pretrained(folder)
    processor = Owlv2Processor(
        image_processor=Owlv2ImageProcessor(size={"height": image_size, "width": image_size}), tokenizer=tokenizer
    )
    processor.save_pretrained(folder)
    return folder


def save_tiny_mask2former(
    folder: str | Path, *, seed: int = 0, image_size: int = 64, num_labels: int = 80, favour: tuple[int, ...] = ()
) -> Path:
    """A random Mask2Former (a 4-stage Swin with one block a stage, 8 queries) with its image
    processor, saved to ``folder``; 80 labels, as COCO's instance models have. ``favour``: label
    ids whose logits get a bias of 6, so that a random model mostly names those."""
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    folder = Path(folder)
    # transformers' @strict dataclass configs take keys beyond their fields through
    # __post_init__(**kwargs); the dataclass signature mypy sees omits them
    backbone = SwinConfig(  # type: ignore[call-arg]
        image_size=image_size,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 2, 2],
        window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(  # type: ignore[call-arg]
        backbone_config=backbone,
        backbone=None,
        use_pretrained_backbone=False,
        hidden_dim=32,
        mask_feature_size=32,
        feature_size=32,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        dim_feedforward=64,
        encoder_feedforward_dim=64,
        num_queries=8,
        num_labels=num_labels,
        id2label={i: f"class {i}" for i in range(num_labels)},
    )
    torch.manual_seed(seed)
    model = Mask2FormerForUniversalSegmentation(config)
    with torch.no_grad():
        model.class_predictor.bias[list(favour)] += 6.0
    model.save_pretrained(folder)
    Mask2FormerImageProcessor(
        size={"shortest_edge": image_size, "longest_edge": image_size}, size_divisor=32
    ).save_pretrained(folder)
    return folder
