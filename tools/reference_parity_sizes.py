#!/usr/bin/env python
"""How large the deviations of issue 21 were (and are): the figures docs/method.md and the parity
table (recipes/references/parity.yaml) quote, measured in one run, offline, on the CPU.

    .venv/bin/python tools/reference_parity_sizes.py

Items: the Wan noise (1), the Qwen-Image window (2), LoRA init (3) and placement (4, on the real
models' published transformer configs, built on the meta device: no weights), precision of
decoding (8), the EMA count (9), the Qwen-Image padding mask (10), Wan's timesteps and grid (11),
DanceGRPO's FLUX schedule (12). Tiny random pipelines stand in for the real networks where a
network is needed: those sizes show the mechanism, not the real model's magnitude.
"""

from __future__ import annotations

import numpy as np
import torch

from fgrpo.core import registry
from fgrpo.models.flux import FluxPolicy
from fgrpo.models.qwen_image import QwenImagePolicy
from fgrpo.models.sd3 import SD3Policy
from fgrpo.models.wan import WanPolicy

#: the transformer configs published with the weights (structure only), as the backbones declare them
SD35_MEDIUM = SD3Policy.published["stabilityai/stable-diffusion-3.5-medium"].config
WAN21_1_3B = WanPolicy.published["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"].config
FLUX1_DEV = FluxPolicy.published["black-forest-labs/FLUX.1-dev"].config
QWEN_IMAGE = QwenImagePolicy.published["Qwen/Qwen-Image"].config
OLD_JOINT = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


def unipc_0_33(steps: int, shift: float) -> torch.Tensor:
    alphas = np.linspace(1, 1 / 1000, steps + 1)
    s = np.flip(shift * (1 - alphas) / (1 + (shift - 1) * (1 - alphas)))[:-1].copy()
    return torch.from_numpy(np.append(s, 0.0)).float()


def stds(kernel: str, sigmas: torch.Tensor, **params) -> torch.Tensor:
    n = sigmas.shape[0] - 1
    x = torch.zeros(n, 1)
    return registry.create("kernel", kernel, **params).step(x, x, sigmas, torch.arange(n), noise=x).std.flatten()


def item1() -> None:
    for steps in (20, 10):
        sigmas = unipc_0_33(steps, 3.0)
        ratio = stds("sde", sigmas, eta=0.7) / stds("wan-sde", sigmas)
        print(
            f"1  Wan, {steps} steps (flow shift 3): sde eta 0.7 std / flow_grpo's Wan std = {ratio[0]:.1f}x at step "
            f"0, "
            f"{ratio[1:].min():.2f}-{ratio[1:].max():.2f}x at steps 1-{steps - 1}"
        )


def item2() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fgrpo.models import _diffusers as dx
    from fgrpo.models.testing.pipelines import QWEN_IMAGE_SCHEDULER

    sigmas, _ = dx.scheduler_grid(
        FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), 10, shift=None, image_seq_len=1024, explicit_grid=True
    )
    var = stds("sde", sigmas, eta=1.2) ** 2
    full, window = float(var[:9].sum()), float(var[3:5].sum())
    print(
        f"2  Qwen-Image 512 px, 10 steps, eta 1.2: injected noise variance of steps 0-8 (before) / of the window 3-4 "
        f"(flow_grpo's) = {full / window:.1f}x; the configured random window 0-3 would have trained steps 0-4"
    )


def item3() -> None:
    from peft import LoraConfig, get_peft_model

    ratios = []
    for seed in range(5):
        changes = {}
        for init in (True, "gaussian"):
            torch.manual_seed(seed)
            layer = torch.nn.Sequential(torch.nn.Linear(1536, 1536))
            model = get_peft_model(
                layer, LoraConfig(r=32, lora_alpha=64, target_modules=["0"], init_lora_weights=init)
            )
            x, target = torch.randn(64, 1536), torch.randn(64, 1536)
            with torch.no_grad():
                before = model(x)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, weight_decay=1e-4)
            for _ in range(3):
                opt.zero_grad()
                ((model(x) - target) ** 2).mean().backward()
                opt.step()
            with torch.no_grad():
                changes[init] = float((model(x) - before).norm())
        ratios.append(changes["gaussian"] / changes[True])
    print(
        f"3  LoRA init (1536 x 1536 linear, r 32, 3 AdamW steps at 3e-4, 5 seeds): output change gaussian / peft "
        f"default = "
        f"{min(ratios):.2f}-{max(ratios):.2f}x"
    )


def lora_parameters(cls, config: dict, targets) -> tuple[int, int]:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    with torch.device("meta"):
        model = cls(**config)
    lora = LoraConfig(r=32, target_modules=list(targets))
    linears = [
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and check_target_module_exists(lora, name)
    ]
    return len(linears), sum(32 * (m.in_features + m.out_features) for m in linears)


def item4() -> None:
    from diffusers import (
        FluxTransformer2DModel,
        QwenImageTransformer2DModel,
        SD3Transformer2DModel,
        WanTransformer3DModel,
    )

    from fgrpo.models.flux import FLUX_LORA_TARGETS
    from fgrpo.models.lora import JOINT_ATTENTION_LORA_TARGETS
    from fgrpo.models.qwen_image import QWEN_IMAGE_LORA_TARGETS
    from fgrpo.models.wan import WAN_LORA_TARGETS

    cases = [
        ("SD3.5-M", SD3Transformer2DModel, SD35_MEDIUM, OLD_JOINT, JOINT_ATTENTION_LORA_TARGETS),
        (
            "Wan 2.1 1.3B",
            WanTransformer3DModel,
            WAN21_1_3B,
            ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
            WAN_LORA_TARGETS,
        ),
        ("FLUX.1-dev", FluxTransformer2DModel, FLUX1_DEV, (*OLD_JOINT, *FLUX_LORA_TARGETS[8:]), FLUX_LORA_TARGETS),
        (
            "Qwen-Image",
            QwenImageTransformer2DModel,
            QWEN_IMAGE,
            (*OLD_JOINT, *QWEN_IMAGE_LORA_TARGETS[8:]),
            QWEN_IMAGE_LORA_TARGETS,
        ),
    ]
    for name, cls, config, old, new in cases:
        (n_old, p_old), (n_new, p_new) = lora_parameters(cls, config, old), lora_parameters(cls, config, new)
        print(
            f"4  LoRA targets on {name} (counted at r 32): before {n_old} linears {p_old / 1e6:.2f} M, now "
            f"(flow_grpo's) "
            f"{n_new} linears {p_new / 1e6:.2f} M: {n_old - n_new:+d} linears, {(p_old - p_new) / 1e6:+.2f} M "
            f"({p_old / p_new - 1:+.0%})"
        )


@torch.no_grad()
def item8() -> None:
    from fgrpo.models.sd3 import SD3Policy
    from fgrpo.models.testing import build_tiny_sd3_pipeline

    keys = {"device": "cpu", "max_sequence_length": 16, "lora": None}
    exact = SD3Policy.from_pipeline(build_tiny_sd3_pipeline(), dtype="float32", **keys)
    half = SD3Policy.from_pipeline(build_tiny_sd3_pipeline(), dtype="bfloat16", **keys)
    x = exact.initial_noise(4, torch.Generator().manual_seed(0))
    gap = (half.decode(x) - exact.decode(x)).abs()
    print(
        f"8  decoding with the VAE in bf16 (before: dtype cast the whole pipeline) against float32 (flow_grpo's), "
        f"tiny SD3 VAE: "
        f"mean {float(gap.mean()) * 255:.2f} / 255, max {float(gap.max()) * 255:.1f} / 255 per pixel"
    )


def item9() -> None:
    for what, repeats in (("SD3 recipes, 8 GPUs", 8), ("SD3, 32 GPUs", 2), ("FLUX, 8 GPUs", 24), ("Wan", 1)):
        print(
            f"9  EMA ({what}): flow_grpo applies its update {repeats}x per qualifying step: weight of the new "
            f"weights {1 - 0.9**repeats:.3f} instead of 0.100 (decay 0.9); qualifying steps 7, 15, ... instead of 8, "
            f"16, ..."
        )


@torch.no_grad()
def item10() -> None:
    from fgrpo.models.qwen_image import QwenImagePolicy
    from fgrpo.models.testing import build_tiny_qwen_image_pipeline

    keys = {"device": "cpu", "max_sequence_length": 32, "resolution": 64, "true_cfg_scale": 1.0}
    for masked in (True, False):
        policy = QwenImagePolicy.from_pipeline(build_tiny_qwen_image_pipeline(), text_padding_mask=masked, **keys)
        x = policy.initial_noise(2, torch.Generator().manual_seed(0))
        sigma = torch.full((2,), 0.6)
        together = policy.velocity(x, sigma, policy.encode(["hi", "a red circle to the left of a cat"]))[0]
        alone = policy.velocity(x[:1], sigma[:1], policy.encode(["hi"]))[0]
        change = float((together - alone).norm() / alone.norm())
        print(
            f"10 Qwen-Image padding {'masked' if masked else 'unmasked (flow_grpo)'}: a short prompt's velocity "
            f"batched with a "
            f"longer one moves by {change:.1%} of its norm (tiny random Qwen-Image)"
        )


@torch.no_grad()
def item11() -> None:
    from diffusers import UniPCMultistepScheduler

    from fgrpo.models.testing import build_tiny_wan_pipeline
    from fgrpo.models.wan import WanPolicy

    def policy(**keys):
        pipe = build_tiny_wan_pipeline()
        pipe.scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
        return WanPolicy.from_pipeline(
            pipe, device="cpu", max_sequence_length=16, resolution=32, num_frames=5, guidance_scale=1.0, **keys
        )

    ints, floats = policy(), policy(integer_timesteps=False)
    sigmas = ints.sigmas(20)
    cond = ints.encode(["a sign"])
    x = ints.initial_noise(1, torch.Generator().manual_seed(0))
    rel = [
        float(
            (ints.velocity(x, s.expand(1), cond) - floats.velocity(x, s.expand(1), cond)).norm()
            / floats.velocity(x, s.expand(1), cond).norm()
        )
        for s in sigmas[:-1]
    ]
    old = policy(sigma_grid="diffusers-0.33")
    gap = (old.sigmas(20) - sigmas).abs()
    print(
        f"11 Wan timesteps: float sigma*1000 (before) against UniPC's int64 (999 at sigma {float(sigmas[0]):.6f}): "
        f"velocity "
        f"{min(rel):.2%}-{max(rel):.2%} apart over the 20 steps (tiny random Wan); diffusers 0.33.1's grid "
        f"(flow_grpo) against "
        f"0.42.1's: up to {float(gap.max()):.4f} in sigma (step {int(gap.argmax())})"
    )


def item12() -> None:
    from fgrpo.samplers import schedules

    tokens = (720 // 16) ** 2
    dynamic = schedules.flux_shift(schedules.linear(16), tokens)
    fixed = schedules.time_shift(schedules.linear(16), 3.0)
    truncated = torch.floor(fixed * 1000) / 1000
    print(
        f"12 FLUX at DanceGRPO/MixGRPO's 720 px, 16 steps: the dynamic mu (fgrpo's default, flow_grpo's) against "
        f"shift 3 on "
        f"linspace(1, 0, 17) (theirs: model.shift 3): up to {float((dynamic - fixed).abs().max()):.3f} in sigma; "
        f"their "
        f"int(sigma*1000)/1000 timesteps (integer_timesteps: true) move sigma by up to "
        f"{float((fixed - truncated).abs().max()):.4f}"
    )


def main() -> None:
    torch.set_num_threads(1)
    for item in (item1, item2, item3, item4, item8, item9, item10, item11, item12):
        item()


if __name__ == "__main__":
    main()
