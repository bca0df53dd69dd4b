"""The tools under tools/ that the closing notes quote figures from."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

world = pytest.importorskip("fgrpo.rewards.shapes")


def _load(root, name):
    spec = importlib.util.spec_from_file_location(name, root / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_relation_probe_reads_objects_and_relation_separately(root):
    probe = _load(root, "shapes_relation_probe")
    _, test = world.split(0, 16)
    position = [p for p in test if world.parse_prompt(p).category == "position"]
    rng = np.random.default_rng(0)
    scenes = [world.place(p, rng) for p in position]
    assert probe.rates(world.render_batch(scenes), position) == (1.0, 1.0)

    swapped = [world.perturb(s, p, rng, kind="position") for s, p in zip(scenes, position, strict=True)]
    assert probe.rates(world.render_batch(swapped), position) == (1.0, 0.0)  # right objects, wrong place

    recoloured = [world.perturb(s, p, rng, kind="color") for s, p in zip(scenes, position, strict=True)]
    objects, relation = probe.rates(world.render_batch(recoloured), position)
    assert objects == 0.0 and math.isnan(relation)  # no image has the objects: nothing to condition on

    mixed = scenes[:4] + swapped[4:8]
    assert probe.rates(world.render_batch(mixed), position[:8]) == (1.0, 0.5)


def test_relation_outcomes_per_image(root):
    probe = _load(root, "shapes_relation_probe")
    _, test = world.split(0, 16)
    position = [p for p in test if world.parse_prompt(p).category == "position"][:6]
    rng = np.random.default_rng(1)
    scenes = [world.place(p, rng) for p in position]
    swapped = [world.perturb(s, p, rng, kind="position") for s, p in zip(scenes, position, strict=True)]
    recoloured = [world.perturb(s, p, rng, kind="color") for s, p in zip(scenes, position, strict=True)]
    images = world.render_batch(scenes[:2] + swapped[2:4] + recoloured[4:])
    assert probe.outcomes(images, position) == [1, 1, 0, 0, None, None]
    single = [p for p in test if world.parse_prompt(p).category == "single"][:1]
    assert probe.outcomes(world.render_batch([world.place(single[0], rng)]), single) == [1]


def test_text_probe_compares_opposite_relations(root):
    probe = _load(root, "shapes_relation_probe")
    prompts = [
        "a red square to the left of a blue circle",
        "a red square to the right of a blue circle",
        "a blue circle to the left of a red square",
        "a red square above a blue circle",
    ]
    codes = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0], [0.0, 1.0]])

    def encode(batch):  # one row per prompt; pooled is twice the tokens
        rows = codes[[prompts.index(q) for q in batch]]
        return {"prompt_embeds": rows[:, None, :], "pooled_prompt_embeds": 2 * rows}

    found = probe.text_distances(encode, prompts, pairs=8)
    assert found["relation word flipped"] == pytest.approx(
        (5.0, 10.0)
    )  # left<->right both ways; "above" has no "below"
    assert found["objects swapped"] == pytest.approx((10.0, 20.0))
    assert set(found) == {"relation word flipped", "objects swapped", "random pair"}
    assert probe.opposites(prompts[3]) == {
        "relation word flipped": "a red square below a blue circle",
        "objects swapped": "a blue circle above a red square",
    }


def test_marginal_probe_knows_the_conditional_mean_exactly(root):
    probe = _load(root, "shapes_relation_probe")
    prompt = "a red square to the left of a blue circle"
    scenes = probe.relation_scenes(prompt)
    assert len(scenes) == 27 and len(set(scenes)) == 27  # 3 rows x 3 rows x 3 column pairs a < b
    assert all(world.satisfies(s, world.parse_prompt(prompt)) for s in scenes)

    mean, variance = probe.conditional_moments(prompt)
    drawn = world.render_batch([world.place(prompt, np.random.default_rng(i)) for i in range(3000)]).double() * 2 - 1
    assert (drawn.mean(0) - mean).abs().max() < 0.06  # the data's uniform draw, by Monte Carlo
    assert variance == pytest.approx((drawn - mean).pow(2).mean().item(), rel=0.02)

    flipped, _ = probe.conditional_moments("a red square to the right of a blue circle")
    assert probe.relation_coefficient(mean, prompt) == pytest.approx(0.5)
    assert probe.relation_coefficient(flipped, prompt) == pytest.approx(-0.5)
    assert probe.relation_coefficient((mean + flipped) / 2, prompt) == pytest.approx(0.0, abs=1e-12)

    exact = world.render_batch(scenes).double() * 2 - 1  # worth, from its definition
    blind, knowing = ((exact - (mean + flipped) / 2).pow(2).mean(), (exact - mean).pow(2).mean())
    assert probe.relation_worth(prompt) == pytest.approx(((blind - knowing) / blind).item())


def test_reference_parity_sizes_lora_counts_on_the_real_configs(root):
    """The LoRA figures docs/method.md and docs/backbones.md quote (issue 21, item 4), counted on the
    published SD3.5-M and Wan 2.1 1.3B transformer configs built on the meta device."""
    pytest.importorskip("diffusers")
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel

    from fgrpo.models.lora import JOINT_ATTENTION_LORA_TARGETS
    from fgrpo.models.wan import WAN_LORA_TARGETS

    sizes = _load(root, "reference_parity_sizes")
    old, new = (
        sizes.lora_parameters(SD3Transformer2DModel, sizes.SD35_MEDIUM, t)
        for t in (sizes.OLD_JOINT, JOINT_ATTENTION_LORA_TARGETS)
    )
    assert (
        (old[0] - new[0], new[0]) == (52, 191)
        and round((old[1] - new[1]) / 1e6, 2) == 5.11
        and round(old[1] / new[1] - 1, 2) == 0.27
    )
    wan_old = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    old, new = (sizes.lora_parameters(WanTransformer3DModel, sizes.WAN21_1_3B, t) for t in (wan_old, WAN_LORA_TARGETS))
    assert new[0] == 240 and round(old[1] / new[1] - 1, 2) == 0.85


def test_memory_estimate_counts_the_pipelines_own_sizes(root, tmp_path, capsys, monkeypatch):
    """tools/memory.py on a tiny Wan 2.2 MoE pipeline (both experts with LoRA): parameters counted
    from the configs on the meta device equal the built modules', the LoRA size equals peft's, and
    the launch kinds split what they split."""
    pytest.importorskip("diffusers")
    import json

    import yaml

    from fgrpo.core import registry
    from fgrpo.models.testing import build_tiny_wan22_pipeline

    memory = _load(root, "memory")
    pipe = build_tiny_wan22_pipeline(tmp_path / "tiny")
    recipe = {
        "model": {
            "name": "wan",
            "path": str(tmp_path / "tiny"),
            "resolution": 32,
            "num_frames": 5,
            "lora": {"rank": 4},
            "max_sequence_length": 16,
            "guidance_scale": 4.0,
        },
        "sampler": {"name": "fast", "steps": 4, "window": 2},
        "train": {"prompts_per_iteration": 4, "group_size": 4, "micro_batch_size": 2, "ema_decay": 0.9},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert memory.main([str(tmp_path / "r.yaml"), "--gpus", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sizes = result["sizes"]
    assert sizes["exact"] and sizes["transformers"] == [
        sum(p.numel() for p in m.parameters()) for m in (pipe.transformer, pipe.transformer_2)
    ]
    assert sizes["text"] == sum(p.numel() for p in pipe.text_encoder.parameters())
    policy = registry.create("model", "wan", **{k: v for k, v in recipe["model"].items() if k != "name"}, device="cpu")
    assert sum(sizes["lora"]) == sum(
        p.numel() for p in policy.trainable_parameters()
    )  # peft's adapter on both experts
    assert result["tokens"] == [2 * 2 * 2, 16]
    kinds = result["kinds"]
    assert (
        kinds["fsdp"]["weights"] < kinds["ddp"]["weights"]
        and kinds["deepspeed-zero2"]["weights"] == kinds["ddp"]["weights"]
    )
    assert kinds["deepspeed-zero2"]["grads+adamw"] == kinds["ddp"]["grads+adamw"] / 2
    assert kinds["zero2-offload"]["grads+adamw"] == kinds["deepspeed-zero2"]["grads+adamw"] / 3
    assert (
        kinds["deepspeed-zero3"]["weights"] == kinds["fsdp"]["weights"]
        and kinds["deepspeed-zero3"]["ema"] == kinds["fsdp"]["ema"]
    )
    assert (
        kinds["zero3-offload"]["weights"] < kinds["deepspeed-zero3"]["weights"] and kinds["zero3-offload"]["ema"] == 0
    )
    assert kinds["zero3-offload"]["grads+adamw"] == kinds["zero2-offload"]["grads+adamw"]
    assert result["activations"]["checkpointing"] < result["activations"]["none"]
    assert memory.main([str(tmp_path / "r.yaml"), "--gpus", "0"]) == 2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing cached: the published sizes
    assert memory.main([str(root / "recipes" / "wan22-t2v-pickscore.yaml"), "--gpus", "8"]) == 0
    printed = capsys.readouterr().out
    assert "| fsdp |" in printed and "published, approximate" in printed and "14.30B + 14.30B" in printed
