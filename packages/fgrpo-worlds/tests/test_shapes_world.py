"""The shapes world: glyphs, the prompt grammar (round trip, categories), the scene-disjoint
split, scene sampling and caption noise."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from fgrpo.worlds.shapes import scenes, world
from fgrpo.worlds.shapes.scenes import perturb, perturbations_for, place, sample_images, sample_scene
from fgrpo.worlds.shapes.world import (
    CATEGORIES,
    Placed,
    Spec,
    all_prompts,
    all_specs,
    parse_prompt,
    render,
    render_batch,
    satisfies,
    split,
)


def test_glyphs_are_centred_and_pairwise_twelve_pixels_apart():
    t = world.TEMPLATES
    assert t.shape == (3, 8, 8)
    assert [int(m.sum()) for m in t] == [36, 24, 24]
    for m in t:  # 1-pixel black margin
        assert not m[0].any() and not m[-1].any() and not m[:, 0].any() and not m[:, -1].any()
        assert (m == m[:, ::-1]).all()  # left-right symmetric
    for a, b in itertools.combinations(range(3), 2):
        assert int((t[a] != t[b]).sum()) == 12


def test_render_is_exact():
    image = render((Placed("red", "square", 0, 0), Placed("yellow", "circle", 2, 1)))
    assert image.shape == (24, 24, 3) and image.dtype == np.uint8
    assert (image[1:7, 1:7] == (255, 0, 0)).all()
    assert (image[0, :8] == 0).all() and (image[7, :8] == 0).all()
    assert (image[16 + 3, 8 + 1 : 8 + 7] == (255, 255, 0)).all()  # widest circle row
    assert (image[16 + 1, 8 + 3 : 8 + 5] == (255, 255, 0)).all() and (image[17, 8 + 2] == 0).all()
    colours = {tuple(p) for p in image.reshape(-1, 3)}
    assert colours == {(0, 0, 0), (255, 0, 0), (255, 255, 0)}
    batch = render_batch([(Placed("blue", "triangle", 1, 1),)])
    assert batch.shape == (1, 3, 24, 24) and batch.dtype.is_floating_point
    assert float(batch.max()) == 1.0 and float(batch[0, 2, 8 + 6, 8 + 1]) == 1.0
    with pytest.raises(ValueError, match="two objects in cell"):
        render((Placed("red", "square", 0, 0), Placed("blue", "square", 0, 0)))
    with pytest.raises(ValueError, match="outside"):
        Placed("red", "square", 3, 0)


def test_category_sizes_and_the_two_object_partition():
    sizes = {c: len(all_specs(c)) for c in CATEGORIES}
    assert sizes == {"single": 12, "two": 60, "counting": 36, "position": 528, "color_attr": 72}
    for spec in all_specs("two"):
        (ca, sa, _), (cb, sb, _) = spec.objects
        assert (ca == cb) != (sa == sb)
    for spec in all_specs("color_attr"):
        (ca, sa, _), (cb, sb, _) = spec.objects
        assert ca != cb and sa != sb
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == sum(sizes.values())


def test_every_prompt_round_trips():
    for category in CATEGORIES:
        for spec in all_specs(category):
            prompt = spec.prompt
            assert parse_prompt(prompt) == spec
            assert Spec.from_dict(spec.to_dict()) == spec
            assert parse_prompt(prompt).category == category


def test_prompt_texts_and_tolerant_parsing():
    assert Spec("single", (("red", "circle", 1),)).prompt == "a red circle"
    assert Spec("counting", (("blue", "circle", 3),)).prompt == "three blue circles"
    assert Spec("two", (("red", "circle", 1), ("blue", "circle", 1))).prompt == "a red circle and a blue circle"
    spec = Spec("position", (("red", "square", 1), ("green", "circle", 1)), "left")
    assert spec.prompt == "a red square to the left of a green circle"
    assert parse_prompt("  A Red  Square to the LEFT of a green circle. ") == spec
    assert parse_prompt("a green triangle and a yellow square").category == "color_attr"
    for bad in (
        "a red circles",
        "two red circle",
        "a purple circle",
        "a red circle and a red circle",
        "two red circles and a blue square",
        "a red square next to a green circle",
        "",
    ):
        with pytest.raises(ValueError, match="not a shapes prompt"):
            parse_prompt(bad)


def test_split_is_disjoint_by_scene_balanced_and_deterministic():
    train, test = split(seed=0, test_per_category=16)
    assert set(train).isdisjoint(test)
    train_keys = {parse_prompt(p).key() for p in train}
    test_keys = {parse_prompt(p).key() for p in test}
    assert train_keys.isdisjoint(test_keys)
    all_keys = {s.key() for c in CATEGORIES for s in all_specs(c)}
    assert train_keys | test_keys == all_keys
    per_category = Counter(parse_prompt(p).category for p in test)
    assert per_category == {"single": 6, "two": 15, "counting": 16, "position": 16, "color_attr": 16}
    assert len(test) == len(set(test))
    assert split(seed=0, test_per_category=16) == (train, test)
    assert split(seed=1, test_per_category=16)[1] != test
    small_train, small_test = split(seed=3, test_per_category=4, categories=("counting",))
    assert len(small_test) == 4 and len(small_train) == 32
    assert {parse_prompt(p).category for p in small_train} == {"counting"}


def test_placed_scenes_satisfy_their_spec():
    rng = np.random.default_rng(0)
    for category in CATEGORIES:
        specs = all_specs(category)
        for spec in specs[:: max(1, len(specs) // 40)]:
            scene = place(spec, rng)
            assert satisfies(scene, spec), (spec.prompt, scene)
            assert len({(p.row, p.col) for p in scene}) == len(scene)
            render(scene)


def test_every_perturbation_breaks_the_caption():
    rng = np.random.default_rng(1)
    seen = Counter()
    for category in CATEGORIES:
        for spec in all_specs(category)[:10]:
            scene = place(spec, rng)
            for kind in perturbations_for(spec):
                bad = perturb(scene, spec, rng, kind)
                assert not satisfies(bad, spec), (spec.prompt, kind, bad)
                render(bad)
                seen[kind] += 1
    assert set(seen) == set(scenes.PERTURBATIONS)
    spec = parse_prompt("a red circle")
    with pytest.raises(ValueError, match="does not apply"):
        perturb(place(spec, 0), spec, 0, "binding")


def test_caption_noise_rate_and_determinism():
    prompts = split(0)[0][:200]
    clean = [sample_scene(p, np.random.default_rng(i), caption_noise=0.0) for i, p in enumerate(prompts)]
    assert all(satisfies(s, parse_prompt(p)) for s, p in zip(clean, prompts, strict=True))
    noisy = [sample_scene(p, np.random.default_rng(i), caption_noise=1.0) for i, p in enumerate(prompts)]
    assert not any(satisfies(s, parse_prompt(p)) for s, p in zip(noisy, prompts, strict=True))
    rng = np.random.default_rng(7)
    half = [satisfies(sample_scene(p, rng, caption_noise=0.5), parse_prompt(p)) for p in prompts]
    assert 70 <= sum(half) <= 130
    a = sample_images(prompts[:8], 5, caption_noise=0.5)
    b = sample_images(prompts[:8], 5, caption_noise=0.5)
    assert a.shape == (8, 3, 24, 24) and (a == b).all()
    with pytest.raises(ValueError, match="caption_noise"):
        sample_scene("a red circle", 0, caption_noise=1.5)
