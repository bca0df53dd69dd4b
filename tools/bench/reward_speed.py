#!/usr/bin/env python
"""Seconds per image of each reward on this CPU, for docs/rewards.md.

No reward weights ship on PyPI and nothing downloads here, so the model-based rewards run their
real architectures at full size with random weights (the cost of a forward pass does not depend on
the weights' values): CLIP ViT-L/14 (clip-score, aesthetic, geneval's colours), CLIP ViT-H/14
(pickscore, hpsv2), BLIP ViT-L/16 + BERT-base with cross-attention (imagereward), Mask2Former
Swin-S (geneval's detector, at 384 pixels). OCR, JPEG and the shapes verifier run for real.
Every reward scores ``--images`` images of ``--size`` pixels in one call, after one warm-up call.

    OMP_NUM_THREADS=1 python tools/bench/reward_speed.py --images 4 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch


def clip_config(vision: tuple[int, int, int, int, int], text: tuple[int, int, int, int], projection: int, act: str):
    from transformers import CLIPConfig

    from fgrpo.rewards.testing import clip_tokenizer

    vocab = clip_tokenizer().get_vocab()
    w, layers, heads, ff, patch = vision
    tw, tlayers, theads, tff = text
    return CLIPConfig(
        vision_config=dict(
            hidden_size=w,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=ff,
            patch_size=patch,
            image_size=224,
            projection_dim=projection,
            hidden_act=act,
        ),
        text_config=dict(
            hidden_size=tw,
            num_hidden_layers=tlayers,
            num_attention_heads=theads,
            intermediate_size=tff,
            vocab_size=len(vocab),
            max_position_embeddings=77,
            projection_dim=projection,
            hidden_act=act,
            eos_token_id=vocab["<|endoftext|>"],
            bos_token_id=vocab["<|startoftext|>"],
        ),
        projection_dim=projection,
    )


def clip(config):
    from transformers import CLIPModel

    from fgrpo.rewards.clip import CLIP
    from fgrpo.rewards.testing import clip_tokenizer

    image = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}}
    return CLIP(CLIPModel(config).eval().requires_grad_(False), clip_tokenizer(), image)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="reward names to measure")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fgrpo.core import registry
    from fgrpo.rewards import clip as clip_mod
    from fgrpo.rewards.aesthetic import aesthetic_head

    n = args.images
    images = torch.rand(n, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
    prompts = ['a photo of a red "GRPO" sign'] * n

    def vit_l():
        return clip(clip_config((1024, 24, 16, 4096, 14), (768, 12, 12, 3072), 768, "quick_gelu"))

    def vit_h():
        return clip(clip_config((1280, 32, 16, 5120, 14), (1024, 24, 16, 4096), 1024, "gelu"))

    def similarity(make, divisor):
        model = make()
        return lambda x, p, m: clip_mod.similarity_reward(model, x, p, 8, divisor, "bench")

    def aesthetic():
        model, head = vit_l(), aesthetic_head(768).eval()
        return lambda x, p, m: head(clip_mod.image_embeddings(model, x, 8))

    def imagereward():
        from transformers import BertTokenizerFast, BlipTextConfig, BlipVisionConfig
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        from fgrpo.rewards.imagereward import ImageReward, LoadedImageReward

        vision = BlipVisionModel(
            BlipVisionConfig(
                hidden_size=1024,
                intermediate_size=4096,
                num_hidden_layers=24,
                num_attention_heads=16,
                image_size=224,
                patch_size=16,
                layer_norm_eps=1e-6,
            )
        ).eval()
        text = BlipTextModel(
            BlipTextConfig(vocab_size=30524, encoder_hidden_size=1024), add_pooling_layer=False
        ).eval()
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]
        import tempfile
        from pathlib import Path

        folder = Path(tempfile.mkdtemp())
        (folder / "vocab.txt").write_text("\n".join(vocab))
        reward = ImageReward.__new__(ImageReward)
        reward.batch_size = 8
        reward._model = LoadedImageReward(
            vision, text, aesthetic_head(768).eval(), BertTokenizerFast(str(folder / "vocab.txt"))
        )
        return reward

    def geneval():
        from transformers import (
            Mask2FormerConfig,
            Mask2FormerForUniversalSegmentation,
            Mask2FormerImageProcessor,
            SwinConfig,
        )

        from fgrpo.rewards.geneval import COCO_CLASSES, ColourClassifier, Mask2FormerDetector, Verifier, verdict_result

        backbone = SwinConfig(
            embed_dim=96,
            depths=[2, 2, 18, 2],
            num_heads=[3, 6, 12, 24],
            window_size=7,
            out_features=["stage1", "stage2", "stage3", "stage4"],
        )
        model = Mask2FormerForUniversalSegmentation(
            Mask2FormerConfig(backbone_config=backbone, backbone=None, use_pretrained_backbone=False, num_labels=80)
        ).eval()
        processor = Mask2FormerImageProcessor(size={"shortest_edge": 384, "longest_edge": 1333})
        detector = Mask2FormerDetector(model, processor, COCO_CLASSES, 0.3)
        verifier = Verifier(detector, ColourClassifier(vit_l()))
        meta = [
            {
                "tag": "color_attr",
                "include": [
                    {"class": "car", "count": 1, "color": "red"},
                    {"class": "dog", "count": 1, "color": "blue"},
                ],
            }
        ] * n
        return lambda x, p, m: verdict_result(verifier.verdicts(x, meta), ["color_attr"] * n, "partial")

    builders = {
        "jpeg-compressibility": lambda: registry.create("reward", "jpeg-compressibility"),
        "ocr": lambda: registry.create("reward", "ocr", threads=args.threads),
        "clip-score": lambda: similarity(vit_l, 100.0),
        "aesthetic": aesthetic,
        "pickscore": lambda: similarity(vit_h, 26.0),
        "hpsv2": lambda: similarity(vit_h, 100.0),
        "imagereward": imagereward,
        "geneval": geneval,
    }
    print(f"{n} images {args.size}x{args.size}, {args.threads} thread(s), random weights at full size")
    for name, build in builders.items():
        if args.only and name not in args.only:
            continue
        reward = build()
        with torch.no_grad():
            reward(images[:1], prompts[:1], [{}])
            t0 = time.perf_counter()
            reward(images, prompts, [{}] * n)
            dt = time.perf_counter() - t0
        print(f"{name:22s} {dt / n:7.3f} s/image", flush=True)
        del reward


if __name__ == "__main__":
    main()
