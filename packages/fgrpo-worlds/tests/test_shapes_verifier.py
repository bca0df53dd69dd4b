"""The shapes verifier: exact scores on known scenes and near-misses, rejection of the drift the
feasibility prototypes saw (speckle, faint colour shifts, broken glyphs), tolerance of small
continuous noise, and the gold metric."""

from __future__ import annotations

from fractions import Fraction
from itertools import pairwise

import numpy as np
import pytest
import torch

from fgrpo.core.protocols import Reward
from fgrpo.core.testing import RewardConformance
from fgrpo.worlds.shapes import (
    ShapesGold,
    ShapesPrompts,
    ShapesVerifier,
    evaluate,
    gold_error,
    parse_prompt,
    read_cells,
    render,
    render_batch,
    sample_images,
)
from fgrpo.worlds.shapes.world import Placed as P

GOOD = {
    "a red circle": (P("red", "circle", 1, 1),),
    "a red circle and a red square": (P("red", "circle", 0, 0), P("red", "square", 2, 2)),
    "three blue circles": (P("blue", "circle", 0, 1), P("blue", "circle", 1, 0), P("blue", "circle", 2, 2)),
    "a red square to the left of a green circle": (P("red", "square", 0, 0), P("green", "circle", 2, 2)),
    "a yellow triangle above a blue square": (P("yellow", "triangle", 0, 2), P("blue", "square", 1, 0)),
    "a green triangle and a yellow square": (P("green", "triangle", 1, 2), P("yellow", "square", 0, 1)),
}

RS_LEFT_GC = "a red square to the left of a green circle"
NEAR_MISSES = [  # (prompt, scene, exact partial)
    ("a red circle", (P("blue", "circle", 1, 1),), Fraction(0)),  # wrong colour
    ("a red circle", (P("red", "square", 1, 1),), Fraction(0)),  # wrong shape
    ("a red circle", (), Fraction(0)),  # missing
    ("a red circle", (P("red", "circle", 1, 1), P("red", "circle", 0, 0)), Fraction(1, 2)),  # wrong count
    ("a red circle", (P("red", "circle", 1, 1), P("blue", "square", 0, 0)), Fraction(1, 2)),  # extra
    ("a red circle and a red square", (P("red", "circle", 0, 0),), Fraction(1, 2)),  # missing
    ("a red circle and a red square", (P("red", "circle", 0, 0), P("green", "square", 1, 1)), Fraction(1, 3)),
    ("a red circle and a red square", (P("red", "circle", 0, 0), P("red", "triangle", 1, 1)), Fraction(1, 3)),
    (
        "a red circle and a red square",
        (P("red", "circle", 0, 0), P("red", "square", 1, 1), P("blue", "triangle", 2, 2)),
        Fraction(2, 3),
    ),
    ("three blue circles", (P("blue", "circle", 0, 0), P("blue", "circle", 0, 1)), Fraction(2, 3)),
    (
        "three blue circles",
        tuple(P("blue", "circle", 0, c) for c in range(3)) + (P("blue", "circle", 2, 2),),
        Fraction(3, 4),
    ),
    (
        "three blue circles",
        tuple(P("blue", "circle", 0, c) for c in range(3)) + (P("red", "circle", 2, 2),),
        Fraction(3, 4),
    ),
    ("three blue circles", tuple(P("blue", "square", 0, c) for c in range(3)), Fraction(0)),
    (RS_LEFT_GC, (P("red", "square", 1, 2), P("green", "circle", 0, 0)), Fraction(2, 3)),  # swapped
    (RS_LEFT_GC, (P("red", "square", 0, 1), P("green", "circle", 2, 1)), Fraction(2, 3)),  # same column
    (RS_LEFT_GC, (P("red", "square", 0, 0),), Fraction(1, 3)),  # missing
    (RS_LEFT_GC, (P("red", "square", 0, 0), P("green", "circle", 0, 2), P("blue", "triangle", 2, 2)), Fraction(3, 4)),
    (RS_LEFT_GC, (P("red", "square", 0, 0), P("red", "square", 0, 2), P("green", "circle", 0, 1)), Fraction(1, 2)),
    (RS_LEFT_GC, (P("red", "square", 0, 0), P("blue", "circle", 0, 2)), Fraction(1, 4)),  # wrong colour
    ("a green triangle and a yellow square", (P("yellow", "triangle", 0, 0), P("green", "square", 1, 1)), Fraction(0)),
    ("a green triangle and a yellow square", (P("green", "triangle", 0, 0), P("red", "square", 1, 1)), Fraction(1, 3)),
]


def _images(scenes):
    return render_batch(list(scenes))


def _check(images, prompts, accuracy, partial, clean):
    out = evaluate(images, prompts)
    assert out["accuracy"].tolist() == [float(a) for a in accuracy]
    assert out["partial"].tolist() == pytest.approx([float(p) for p in partial], abs=1e-6)
    assert out["clean"].tolist() == [float(c) for c in clean]
    return out


def test_correct_renders_score_one_in_every_category():
    prompts = list(GOOD)
    assert {parse_prompt(p).category for p in prompts} == {"single", "two", "counting", "position", "color_attr"}
    images = _images(GOOD.values())
    out = _check(images, prompts, [1] * len(prompts), [1] * len(prompts), [1] * len(prompts))
    assert out["gold_error"].tolist() == [0.0] * len(prompts)
    assert out["clean_cells"].tolist() == [1.0] * len(prompts)
    assert out["category"] == [parse_prompt(p).category for p in prompts]
    assert out["category_id"].dtype == torch.long
    reading = read_cells(images)
    for b, scene in enumerate(GOOD.values()):
        assert set(reading.scene(b)) == set(scene)


def test_near_misses_get_the_exact_partial_and_no_accuracy():
    prompts = [p for p, _, _ in NEAR_MISSES]
    images = _images(s for _, s, _ in NEAR_MISSES)
    _check(images, prompts, [0] * len(prompts), [v for _, _, v in NEAR_MISSES], [1] * len(prompts))


def test_small_continuous_noise_still_reads_correctly():
    gen = torch.Generator().manual_seed(0)
    images = _images(GOOD.values()).repeat(4, 1, 1, 1)
    noisy = (images + (torch.rand(images.shape, generator=gen) * 4 - 2) / 255).clamp(0, 1)
    n = len(GOOD)
    _check(noisy, list(GOOD) * 4, [1] * 4 * n, [1] * 4 * n, [1] * 4 * n)
    assert 0 < float(gold_error(noisy).max()) <= 2.0


def _uint8(scene):
    return render(scene).astype(np.int64)


def _batch(arrays):
    return torch.from_numpy(np.stack(arrays).clip(0, 255).astype(np.uint8)).permute(0, 3, 1, 2).float() / 255


CIRCLE = (P("red", "circle", 1, 1),)


def _speckle(value, n=3):
    image = _uint8(CIRCLE)
    for k in range(n):  # a few grey pixels in the empty top-left cell
        image[1 + 2 * k, 2 + k] = value
    return image


def _shift(delta):
    image = _uint8(CIRCLE)
    glyph = (image == (255, 0, 0)).all(-1)
    image[glyph] = (255 - delta, delta, delta)
    return image


def test_speckle_colour_shift_and_broken_glyphs_are_rejected():
    broken = _uint8(CIRCLE)
    broken[8 + 3, 8 + 1 : 8 + 5] = 0  # 4 glyph pixels removed
    one_off = _uint8(CIRCLE)
    one_off[8 + 3, 8 + 1] = 0  # within the 2-pixel glyph tolerance
    mixed = _uint8(CIRCLE)
    mixed[8 + 3 : 8 + 5, 8 + 1 : 8 + 7] = (0, 255, 0)
    images = _batch([_speckle(40), _shift(25), broken, mixed, one_off, _speckle(15), _shift(15)])
    prompts = ["a red circle"] * 7
    # speckle in an empty cell: the red circle counts, the unreadable cell is one unmet constraint
    _check(images, prompts, [0, 0, 0, 0, 1, 1, 1], [0.5, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1])
    reading = read_cells(images)
    assert reading.reasons[0, 0, 0] == 1  # off-palette
    assert reading.reasons[1, 1, 1] == 1
    assert reading.reasons[2, 1, 1] == 3  # broken glyph
    assert reading.reasons[3, 1, 1] == 2  # mixed colours
    assert reading.codes[4, 1, 1] > 0 and reading.reasons[4].sum() == 0
    # below the tolerance nothing is rejected, but the gold metric sees it
    assert (reading.gold_error[4:] > 0).all()
    assert float(reading.gold_error[4]) == pytest.approx(255 / (24 * 24 * 3))


def test_gold_error_is_zero_when_clean_and_grows_with_drift():
    clean = _batch([_uint8(s) for s in GOOD.values()])
    assert gold_error(clean).tolist() == [0.0] * len(GOOD)
    shifts = gold_error(_batch([_shift(d) for d in (0, 5, 10, 20, 21, 30, 60, 120)])).tolist()
    assert shifts[0] == 0.0 and all(a < b for a, b in pairwise(shifts))
    speckles = gold_error(_batch([_speckle(v) for v in (0, 10, 20, 21, 40, 80)])).tolist()
    assert speckles[0] == 0.0 and all(a < b for a, b in pairwise(speckles))
    broken = []
    for k in range(6):
        image = _uint8(CIRCLE)
        image[8 + 3, 8 + 1 : 8 + 1 + k] = 0
        broken.append(image)
    errors = gold_error(_batch(broken)).tolist()
    assert errors[0] == 0.0 and all(a < b for a, b in pairwise(errors))


def test_reward_component_strict_partial_fidelity_and_gold():
    prompts = ["a red circle", "a red circle", "three blue circles"]
    images = torch.cat(
        [
            _images([CIRCLE]),
            _batch([_speckle(40)]),
            _images([(P("blue", "circle", 0, 0), P("blue", "circle", 0, 1))]),
        ]
    )
    partial = ShapesVerifier()
    assert isinstance(partial, Reward)
    result = partial(images, prompts, [{}] * 3)
    assert result.scores.tolist() == pytest.approx([1.0, 0.5, 2 / 3])
    assert result.scores.dtype == torch.float32 and result.scores.shape == (3,)
    assert set(result.details) >= {"accuracy", "partial", "clean", "gold_error", "category", "category_id"}
    strict = ShapesVerifier(score="strict")(images, prompts, [{}] * 3)
    assert strict.scores.tolist() == [1.0, 0.0, 0.0]
    fid = ShapesVerifier(fidelity_weight=1.0)(images, prompts, [{}] * 3)
    expected = result.scores - result.details["gold_error"] / 255
    assert torch.allclose(fid.scores, expected) and fid.scores[1] < 0.5
    gold = ShapesGold()(images, prompts, [{}] * 3)
    assert gold.scores.tolist() == pytest.approx((-result.details["gold_error"]).tolist())
    assert gold.scores[0] == 0 and gold.scores[1] < 0
    uint8 = (images * 255).round().to(torch.uint8)
    assert ShapesVerifier()(uint8, prompts, [{}] * 3).scores.tolist() == pytest.approx([1.0, 0.5, 2 / 3])
    with pytest.raises(ValueError, match="24, 24"):
        partial(torch.zeros(1, 3, 32, 32), ["a red circle"], [{}])


def test_prompt_source_metadata_drives_the_reward():
    source = ShapesPrompts(test_per_category=4)
    prompts = source.test_prompts()
    metadata = [source.metadata(p) for p in prompts]
    assert all(m["spec"] == parse_prompt(p).to_dict() for p, m in zip(prompts, metadata, strict=True))
    clean = sample_images(prompts, 0, caption_noise=0.0)
    wrong = sample_images(prompts, 0, caption_noise=1.0)
    verifier = ShapesVerifier(score="strict")
    assert verifier(clean, prompts, metadata).scores.tolist() == [1.0] * len(prompts)
    assert verifier(wrong, prompts, metadata).scores.tolist() == [0.0] * len(prompts)
    # the metadata's spec wins over the text (a prompt source may phrase prompts its own way)
    other = [{"spec": parse_prompt("a blue square").to_dict()}]
    assert verifier(_images([(P("blue", "square", 0, 0),)]), ["anything"], other).scores.tolist() == [1.0]


def _conformance_inputs():
    gen = torch.Generator().manual_seed(3)
    prompts = ["a red circle", "three blue circles", RS_LEFT_GC, "a red circle"]
    images = torch.cat(
        [
            _images([GOOD["a red circle"], GOOD["three blue circles"], GOOD[RS_LEFT_GC]]),
            _batch([_speckle(40)]),
        ]
    )
    images = (images + torch.rand(images.shape, generator=gen) * 6 / 255).clamp(0, 1)
    source = ShapesPrompts()
    return images, prompts, [source.metadata(p) for p in prompts]


class TestShapesConformance(RewardConformance):
    reward_name = "shapes"
    reward_params = {"score": "partial", "fidelity_weight": 0.5}

    def make_inputs(self):
        return _conformance_inputs()


class TestShapesGoldConformance(RewardConformance):
    reward_name = "shapes-gold"

    def make_inputs(self):
        return _conformance_inputs()


def test_what_was_read_is_described_per_image():
    scene = (P("blue", "circle", 0, 0), P("blue", "circle", 2, 2), P("red", "square", 1, 1))
    broken = _uint8(CIRCLE)
    broken[8 + 3, 8 + 1 : 8 + 5] = 0  # the red circle loses 4 pixels: unreadable
    images = _batch([render(scene), render(()), broken, _speckle(40)])
    reading = read_cells(images)
    assert [reading.describe(b) for b in range(4)] == [
        "2 blue circles, red square",
        "nothing",
        "1 unreadable (broken glyph)",
        "red circle, 1 unreadable (off-palette)",
    ]
    read = evaluate(images, ["a red circle"] * 4)["read"]
    assert read == [reading.describe(b) for b in range(4)]
