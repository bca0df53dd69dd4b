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

    swapped = [world.perturb(s, p, rng, kind="position") for s, p in zip(scenes, position)]
    assert probe.rates(world.render_batch(swapped), position) == (1.0, 0.0)  # right objects, wrong place

    recoloured = [world.perturb(s, p, rng, kind="color") for s, p in zip(scenes, position)]
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
    swapped = [world.perturb(s, p, rng, kind="position") for s, p in zip(scenes, position)]
    recoloured = [world.perturb(s, p, rng, kind="color") for s, p in zip(scenes, position)]
    images = world.render_batch(scenes[:2] + swapped[2:4] + recoloured[4:])
    assert probe.outcomes(images, position) == [1, 1, 0, 0, None, None]
    single = [p for p in test if world.parse_prompt(p).category == "single"][:1]
    assert probe.outcomes(world.render_batch([world.place(single[0], rng)]), single) == [1]


def test_text_probe_compares_opposite_relations(root):
    probe = _load(root, "shapes_relation_probe")
    prompts = ["a red square to the left of a blue circle", "a red square to the right of a blue circle",
               "a blue circle to the left of a red square", "a red square above a blue circle"]
    codes = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0], [0.0, 1.0]])

    def encode(batch):  # one row per prompt; pooled is twice the tokens
        rows = codes[[prompts.index(q) for q in batch]]
        return {"prompt_embeds": rows[:, None, :], "pooled_prompt_embeds": 2 * rows}

    found = probe.text_distances(encode, prompts, pairs=8)
    assert found["relation word flipped"] == pytest.approx((5.0, 10.0))  # left<->right both ways; "above" has no "below"
    assert found["objects swapped"] == pytest.approx((10.0, 20.0))
    assert set(found) == {"relation word flipped", "objects swapped", "random pair"}
    assert probe.opposites(prompts[3]) == {
        "relation word flipped": "a red square below a blue circle", "objects swapped": "a blue circle above a red square"
    }


def test_reference_parity_sizes_lora_counts_on_the_real_configs(root):
    """The LoRA figures docs/method.md and docs/backbones.md quote (issue 21, item 4), counted on the
    published SD3.5-M and Wan 2.1 1.3B transformer configs built on the meta device."""
    pytest.importorskip("diffusers")
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel

    from fgrpo.models.lora import JOINT_ATTENTION_LORA_TARGETS
    from fgrpo.models.wan import WAN_LORA_TARGETS

    sizes = _load(root, "reference_parity_sizes")
    old, new = (sizes.lora_parameters(SD3Transformer2DModel, sizes.SD35_MEDIUM, t) for t in (sizes.OLD_JOINT, JOINT_ATTENTION_LORA_TARGETS))
    assert (old[0] - new[0], new[0]) == (52, 191) and round((old[1] - new[1]) / 1e6, 2) == 5.11 and round(old[1] / new[1] - 1, 2) == 0.27
    wan_old = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    old, new = (sizes.lora_parameters(WanTransformer3DModel, sizes.WAN21_1_3B, t) for t in (wan_old, WAN_LORA_TARGETS))
    assert new[0] == 240 and round(old[1] / new[1] - 1, 2) == 0.85
