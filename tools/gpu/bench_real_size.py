#!/usr/bin/env python
"""fgrpo iterations at real model size, against the floor their network evaluations imply.

    python tools/gpu/bench_real_size.py                 # SD3.5-Medium-size transformer, 512 px
    python tools/gpu/bench_real_size.py --flux          # FLUX.1-dev-size transformer
    python tools/gpu/bench_real_size.py --small --resolution 64 --group 4 --steps 4   # a CPU check

The transformer has the real architecture and random weights in bf16 (SD3.5-Medium: 24 joint
blocks, 24 heads x 64, 13 dual-attention blocks, ~2.5B parameters; FLUX.1-dev: 19 + 38 blocks,
24 heads x 128, ~12B); the text encoders are one-layer stand-ins with the real output widths (the
prompt embeddings are cached after the first iteration anyway) and the VAE a small one with the
real latent layout (16 channels, 8x down-sampling), so the seconds are the transformer's.

For each setting (CFG 4.5 and no CFG; gradient checkpointing on and off) the script measures, in
the same run: the cost of one NFE forward at the rollout's batch, one NFE forward at the
update's batch without gradient (the reference pass of the KL term), one NFE forward+backward at
the update's batch, then full fgrpo iterations (group ``--group``, ``--steps`` SDE steps, LoRA
r32 on both attention streams, the first steps trained as flow_grpo's 0.99 fraction does, KL 0.04,
the whole batch one optimizer step) with a cheap reward on the decoded images. It prints each
iteration's time over its floor: rollout NFE x forward cost + trained NFE x forward+backward cost +
reference NFE x no-grad cost (the target is <= 1.25).

On the GPU machine (torch, transformers, peft, accelerate there; diffusers and fgrpo not):
carry wheels as the device notes say (``.whl``: diffusers and its missing requirements), install
them and fgrpo's packages without dependencies into /tmp/site, then run this script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any


def published_config(flux: bool) -> dict[str, Any]:
    """The SD3.5-Medium or FLUX.1-dev transformer config as published, as the backbones declare it."""
    if flux:
        from fgrpo.models.flux import FluxPolicy

        return dict(FluxPolicy.published["black-forest-labs/FLUX.1-dev"].config or {})
    from fgrpo.models.sd3 import SD3Policy

    return dict(SD3Policy.published["stabilityai/stable-diffusion-3.5-medium"].config or {})


def small(config: dict[str, Any], flux: bool) -> dict[str, Any]:
    """The same architecture shrunk for a CPU check (2 layers, 2 heads x 16, narrow text)."""
    out = dict(config, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32)
    if flux:
        out.update(num_single_layers=2, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    else:
        out.update(
            caption_projection_dim=32, pooled_projection_dim=64, dual_attention_layers=(0,), pos_embed_max_size=64
        )
    return out


def tokenizers() -> tuple[Any, Any]:
    """The offline CLIP and T5 tokenizer builders of fgrpo's testing modules."""
    import importlib

    for name in ("fgrpo.models.testing.pipelines", "fgrpo.models.testing"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "tiny_t5_tokenizer"):
            return module.tiny_clip_tokenizer, module.tiny_t5_tokenizer
    raise SystemExit("fgrpo's tiny tokenizer builders are not installed (fgrpo-models)")


def text_stack(flux: bool, width: int, pooled: int) -> dict[str, Any]:
    """One-layer CLIP(s) and T5 with the real output widths, and tokenizers built offline."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tiny_clip_tokenizer, tiny_t5_tokenizer = tokenizers()

    def clip(hidden: int, projection: int | None) -> Any:
        cfg = CLIPTextConfig(
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_attention_heads=max(1, hidden // 64),
            num_hidden_layers=1,
            vocab_size=514,
            max_position_embeddings=77,
            projection_dim=projection or hidden,
        )
        return CLIPTextModelWithProjection(cfg) if projection else CLIPTextModel(cfg)

    t5 = T5EncoderModel(
        T5Config(
            vocab_size=98,
            d_model=width,
            d_kv=64,
            d_ff=2 * width,
            num_layers=1,
            num_heads=max(1, width // 64),
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    if flux:
        return dict(
            text_encoder=clip(pooled, None),
            tokenizer=tiny_clip_tokenizer(),
            text_encoder_2=t5,
            tokenizer_2=tiny_t5_tokenizer(),
        )
    # SD3: the pooled vector is [CLIP-L, CLIP-G] projections; their hidden states are padded to width
    half = pooled // 2
    return dict(
        text_encoder=clip(half, half),
        tokenizer=tiny_clip_tokenizer(),
        text_encoder_2=clip(pooled - half, pooled - half),
        tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=t5,
        tokenizer_3=tiny_t5_tokenizer(),
    )


def build_pipeline(flux: bool, shrink: bool, dtype: Any) -> Any:
    import diffusers
    import torch

    config = published_config(flux)
    if shrink:
        config = small(config, flux)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        if flux:
            transformer = diffusers.FluxTransformer2DModel(**config)
        else:
            transformer = diffusers.SD3Transformer2DModel(**config)
    transformer.to(dtype)
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 32, 32, 32),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    width = config["joint_attention_dim"]
    pooled = config["pooled_projection_dim"]
    parts = text_stack(flux, width, pooled)
    if flux:
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
        )
        return diffusers.FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, **parts)
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, **parts
    )


def make_policy(pipe: Any, flux: bool, keys: dict[str, Any]) -> Any:
    from fgrpo.core import registry

    return registry.load("model", "flux" if flux else "sd3").from_pipeline(pipe, **keys)


def per_nfe_costs(policy: Any, rollout_rows: int, train_rows: int, repeats: int) -> dict[str, float]:
    """Seconds per NFE: forward at the rollout's batch, no-grad forward and forward+backward at
    the update's batch (each the median of ``repeats`` after a warm-up)."""
    import torch

    from fgrpo.core import tensors, timing

    cond1 = policy.encode(["a photo of a cat holding a sign that says fgrpo"])
    epc = policy.evaluations_per_call

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            timing.synchronize(policy.device)
            t0 = time.perf_counter()
            fn()
            timing.synchronize(policy.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def forward(rows: int, grad: bool) -> float:
        x = torch.randn(rows, *policy.latent_shape, device=policy.device)
        sigma = torch.full((rows,), 0.6, device=policy.device)
        cond = tensors.repeat_interleave(cond1, rows)

        def once():
            if grad:
                policy.velocity(x, sigma, cond).float().square().mean().backward()
            else:
                with torch.no_grad():
                    policy.velocity(x, sigma, cond)

        return timed(once) / (rows * epc)

    return {
        "rollout_fwd": forward(rollout_rows, False),
        "nograd_fwd": forward(train_rows, False),
        "fwd_bwd": forward(train_rows, True),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flux", action="store_true", help="a FLUX.1-dev-size transformer instead of SD3.5-Medium")
    parser.add_argument("--small", action="store_true", help="shrink the architecture (a CPU check of the script)")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=1, help="prompt groups per iteration")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=8, help="(sample, step) pairs per update forward")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per setting (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per per-NFE cost")
    parser.add_argument("--settings", default="cfg,nocfg,cfg+ckpt,nocfg+ckpt")
    args = parser.parse_args(argv)

    import torch
    from rich.console import Console

    from fgrpo.core import recipe as recipe_mod
    from fgrpo.core.building import build_run
    from fgrpo.core.trainer import iteration

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    print(
        f"{'FLUX.1-dev' if args.flux else 'SD3.5-Medium'}-size transformer{' (shrunk)' if args.small else ''}, "
        f"{args.resolution} px, group {args.group} x {args.prompts} prompt(s), {args.steps} steps, LoRA r32, "
        f"{torch.cuda.get_device_name() if cuda else 'CPU'}, {str(dtype).replace('torch.', '')}"
    )
    pipe = build_pipeline(args.flux, args.small, dtype)
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"transformer: {n_params / 1e9:.2f}B parameters")

    for setting in [s for s in args.settings.split(",") if s]:
        guidance = 1.0 if "nocfg" in setting else 4.5
        checkpointing = "ckpt" in setting
        keys = dict(
            dtype=str(dtype).replace("torch.", ""),
            resolution=args.resolution,
            gradient_checkpointing=checkpointing,
            lora={"rank": 32, "alpha": 64, "init": "gaussian"},
            **({"true_cfg_scale": guidance} if args.flux else {"guidance_scale": guidance}),  # FLUX.1-dev: true CFG
        )
        policy = make_policy(pipe, args.flux, keys)
        recipe = recipe_mod.from_text(
            f"""
            seed: 0
            model: {{name: {"flux" if args.flux else "sd3"}, path: unused}}
            sampler: {{name: full, steps: {args.steps}, timestep_fraction: 0.99, kernel: {{name: sde, eta: 0.7}}}}
            reward: {{name: jpeg-compressibility}}
            objective: {{name: grpo, clip_range: 1.0e-4, kl_beta: 0.04}}
            prompts: {{name: list, train: ["a cat holding a sign", "a red bicycle", "a bowl of ramen",
                                          "a lighthouse at night"]}}
            train: {{iterations: 100, group_size: {args.group}, prompts_per_iteration: {args.prompts}, lr: 3.0e-4,
                     micro_batch_size: {args.micro_batch}}}
            log: {{quiet: true, trackers: [], sample_grid: false, plots: false}}
            """,
            source="bench_real_size",
        )
        run = build_run(recipe, out_dir=None, console=Console(quiet=True), quiet=True, policy=policy)
        costs = per_nfe_costs(policy, args.group * args.prompts, args.micro_batch, args.repeats)
        rows = []
        for it in range(args.iterations + 1):
            m = iteration(run, it)
            if it:
                rows.append(m)
        it_s = statistics.median(m["time_iteration_s"] for m in rows)
        m = rows[-1]
        ref = m.get("nfe_reference", 0)
        floor = (
            m["nfe_rollout"] * costs["rollout_fwd"]
            + (m["nfe_train"] - ref) * costs["fwd_bwd"]
            + ref * costs["nograd_fwd"]
        )
        print(
            f"{setting:>11}: forward {costs['rollout_fwd'] * 1e3:.2f} ms/NFE (rollout batch), "
            f"{costs['nograd_fwd'] * 1e3:.2f} (no grad, "
            f"update batch), forward+backward {costs['fwd_bwd'] * 1e3:.2f} ms/NFE; NFE rollout {m['nfe_rollout']}, "
            f"train "
            f"{m['nfe_train'] - ref} + reference {ref}; iteration {it_s:.2f} s, floor {floor:.2f} s, ratio "
            f"{it_s / floor:.2f} "
            f"(model {m['time_model_s']:.2f} s, reward {m['time_reward_s']:.2f}, decode {m['time_decode_s']:.2f}, "
            f"overhead {m['time_overhead_s']:.2f})"
        )
        if checkpointing:
            policy.transformer.disable_gradient_checkpointing()
        del run, policy
        _remove_lora(pipe.transformer)
        if cuda:
            torch.cuda.empty_cache()
    return 0


def _remove_lora(transformer: Any) -> None:
    """Take the adapter out so the next setting starts from the bare transformer."""
    try:
        transformer.delete_adapters("default")
    except Exception:  # older diffusers/peft: unload through peft
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in transformer.modules():
            if isinstance(module, BaseTunerLayer):
                module.delete_adapter("default")


if __name__ == "__main__":
    sys.exit(main())
