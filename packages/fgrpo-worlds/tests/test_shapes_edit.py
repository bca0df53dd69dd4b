"""The shapes-edit world: the instruction grammar, the semantics of each category, the verifier's
two separate scores (edit done; untouched cells preserved) and the prompt source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fgrpo.worlds.shapes_edit as E
from fgrpo.core import media, registry
from fgrpo.core.protocols import PromptSource, Reward
from fgrpo.worlds.shapes.world import CELL, Placed, render_batch

RED_CIRCLE = ("red", "circle")
SOURCE = (Placed("red", "circle", 0, 0), Placed("blue", "square", 1, 1), Placed("red", "circle", 2, 2))


def test_every_instruction_parses_back_and_the_split_holds_out_per_category():
    for category in E.EDIT_CATEGORIES:
        for edit in E.all_edits(category):
            assert E.parse_instruction(edit.instruction) == edit
    assert [len(E.all_edits(c)) for c in E.EDIT_CATEGORIES] == [36, 48, 12, 12, 108]
    train, test = E.split_instructions(0)
    for category, n in E.HELD_OUT.items():
        assert len(test[category]) == n and not set(train[category]) & set(test[category])
        assert len(train[category]) + n == len(E.all_edits(category))
    assert E.split_instructions(0) == (train, test) and E.split_instructions(1)[1] != test
    with pytest.raises(ValueError, match="not a shapes-edit instruction: 'paint it black'"):
        E.parse_instruction("paint it black")


def cells_of(codes):
    return {(r, c) for r in range(3) for c in range(3) if codes[r][c]}


@pytest.mark.parametrize(
    "instruction, source, touched, done",
    [
        (
            "make the blue square green",
            SOURCE,
            {(1, 1)},
            (Placed("red", "circle", 0, 0), Placed("green", "square", 1, 1), Placed("red", "circle", 2, 2)),
        ),
        ("remove the blue square", SOURCE, {(1, 1)}, (SOURCE[0], SOURCE[2])),
        (
            "move the blue square to the top",
            SOURCE,
            {(1, 1), (0, 1)},
            (SOURCE[0], Placed("blue", "square", 0, 1), SOURCE[2]),
        ),
        (
            "change the number of red circles to one",
            SOURCE,
            {(0, 0), (2, 2)} | {c for c in E.ALL_CELLS if c not in {(0, 0), (1, 1), (2, 2)}},
            (SOURCE[1], SOURCE[2]),
        ),
        (
            "add a green triangle",
            SOURCE,
            {c for c in E.ALL_CELLS if c not in {(0, 0), (1, 1), (2, 2)}},
            SOURCE + (Placed("green", "triangle", 0, 2),),
        ),
    ],
)
def test_each_category_touches_its_cells_and_is_verified(instruction, source, touched, done):
    edit = E.parse_instruction(instruction)
    assert E.applies(edit, source)
    assert E.touched_cells(edit, source) == touched
    images = render_batch([done, source])
    result = E.evaluate(images, [edit, edit], [source, source])
    assert result["edit"].tolist() == [1.0, 0.0]  # the edit, and the source copied unchanged
    assert result["preserved"].tolist() == [1.0, 1.0] and result["gold_preservation_error"].tolist() == [0.0, 0.0]
    assert result["category"] == [edit.category] * 2


def test_preservation_is_scored_apart_from_the_edit():
    edit = E.parse_instruction("make the blue square green")
    done = (Placed("red", "circle", 0, 0), Placed("green", "square", 1, 1), Placed("red", "circle", 2, 2))
    clobbered = (Placed("yellow", "circle", 0, 0),) + done[1:]  # edit done, an untouched cell changed
    drift = render_batch([done])
    drift[:, :, :CELL, 2 * CELL :] += 12 / 255  # faint speckle in an untouched empty cell: still reads empty
    images = torch.cat([render_batch([clobbered]), drift.clamp(0, 1)])
    result = E.evaluate(images, [edit, edit], [SOURCE, SOURCE])
    assert result["edit"].tolist() == [1.0, 1.0]
    assert result["preserved"].tolist() == [0.0, 1.0]
    assert result["preserved_cells"][0].item() == pytest.approx(7 / 8)
    error = result["gold_preservation_error"]
    # red -> yellow: the green channel of a circle's 24 pixels off by 255, in one of 8 untouched cells
    assert error[0].item() == pytest.approx(255 * 24 / (64 * 3) / 8, rel=1e-4)
    assert error[1].item() == pytest.approx(12 / 8, rel=1e-4)  # one of 8 untouched cells off by 12 everywhere


def test_mistakes_stay_inside_the_touched_cells_and_pairs_are_seeded():
    rng = np.random.default_rng(0)
    train, _ = E.split_instructions(0)
    for edits in train.values():
        for edit in edits[:10]:
            source = E.random_source(edit, rng)
            assert E.applies(edit, source)
            for result in (E.apply(edit, source, rng), E.mistake(edit, source, rng)):
                changed = {
                    (r, c)
                    for r in range(3)
                    for c in range(3)
                    if E.scene_codes(result)[r, c] != E.scene_codes(source)[r, c]
                }
                assert changed <= E.touched_cells(edit, source)
            images = render_batch([E.apply(edit, source, rng), E.mistake(edit, source, rng)])
            assert E.evaluate(images, [edit, edit], [source, source])["edit"].tolist() == [1.0, 0.0]
    a = E.edit_pair(train["move"][0], np.random.default_rng(3), noise=0.5)
    assert a == E.edit_pair(train["move"][0], np.random.default_rng(3), noise=0.5)


def test_prompt_source_and_reward_through_the_registry():
    source = registry.create("prompts", "shapes-edit", train_size=50, test_per_category=4)
    assert isinstance(source, PromptSource)
    train, test = source.train_prompts(), source.test_prompts()
    assert len(train) == 50 and len(test) == 20
    _, held_out = E.split_instructions(0)
    held = {e.instruction for edits in held_out.values() for e in edits}
    assert all(p.text in held for p in test) and not any(p.text in held for p in train)
    prompt = test[0]
    assert isinstance(prompt, media.Prompt) and len(prompt.images) == 1
    assert media.load_image(prompt.images[0]).size == (24, 24)
    meta = source.metadata(prompt)
    edit, scene = E.edit_and_source(prompt, meta)
    assert E.edit_and_source(prompt, None) == (edit, scene) and meta["category"] == edit.category
    reward = registry.create("reward", "shapes-edit")
    assert isinstance(reward, Reward)
    rng = np.random.default_rng(1)
    outputs = render_batch([E.apply(*E.edit_and_source(p, source.metadata(p)), rng) for p in test])
    result = reward(outputs, test, [source.metadata(p) for p in test])
    assert result.scores.tolist() == [1.0] * 20 and result.details["preserved"].tolist() == [1.0] * 20
    partial = registry.create("reward", "shapes-edit", score="partial")
    copies = render_batch([E.edit_and_source(p, None)[1] for p in test])
    scores = partial(copies, test, [source.metadata(p) for p in test]).scores
    assert bool((scores < 1).all()) and bool((scores >= 0).all())
