"""The tools under tools/ that the closing notes quote figures from."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest

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
