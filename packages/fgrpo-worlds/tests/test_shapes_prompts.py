"""The ``shapes`` prompt source and the entry points of the shapes world."""

from __future__ import annotations

from collections import Counter

import pytest

from fgrpo.core import registry
from fgrpo.core.config import RecipeError
from fgrpo.core.protocols import PromptSource, Reward
from fgrpo.worlds.shapes import ShapesPrompts, parse_prompt, split


def test_registered_and_built_through_the_registry():
    assert {"shapes", "shapes-gold"} <= set(registry.names("reward"))
    assert "shapes" in registry.names("prompts")
    source = registry.create("prompts", "shapes", seed=2, test_per_category=8)
    assert isinstance(source, PromptSource)
    assert isinstance(registry.create("reward", "shapes", score="strict"), Reward)
    assert isinstance(registry.create("reward", "shapes-gold"), Reward)
    with pytest.raises(RecipeError) as info:
        registry.create("prompts", "shapes", categories=["single", "colour"], test_per_category=0)
    text = str(info.value)
    assert "prompts.categories: got ['single', 'colour']; unknown 'colour'" in text
    assert "prompts.test_per_category: got 0; allowed: >= 1" in text
    with pytest.raises(RecipeError, match="reward.score"):
        registry.create("reward", "shapes", score="soft")


def test_train_and_test_are_disjoint_balanced_and_seeded():
    source = ShapesPrompts(seed=0, test_per_category=16)
    train, test = source.train_prompts(), source.test_prompts()
    assert set(train).isdisjoint(test)
    assert test == split(0, 16)[1]
    assert set(train) == set(split(0, 16)[0])
    per_category = Counter(source.metadata(p)["category"] for p in train)
    assert set(per_category) == {"single", "two", "counting", "position", "color_attr"}
    assert max(per_category.values()) / min(per_category.values()) < 1.1
    assert train != sorted(train, key=lambda p: parse_prompt(p).category)  # shuffled
    assert ShapesPrompts(seed=0).train_prompts() == ShapesPrompts(seed=0).train_prompts()
    assert ShapesPrompts(seed=1).test_prompts() != test
    plain = ShapesPrompts(balance=False).train_prompts()
    assert len(plain) == len(set(plain)) == 592


def test_category_subset_and_metadata():
    source = ShapesPrompts(categories=["position"], test_per_category=10)
    assert len(source.test_prompts()) == 10
    assert {source.metadata(p)["category"] for p in source.train_prompts()} == {"position"}
    meta = source.metadata("a red square to the left of a green circle")
    assert meta == {
        "category": "position",
        "spec": {
            "category": "position",
            "objects": [
                {"color": "red", "shape": "square", "count": 1},
                {"color": "green", "shape": "circle", "count": 1},
            ],
            "relation": "left",
        },
    }
    with pytest.raises(ValueError, match="not a shapes prompt"):
        source.metadata("a photo of a dog")
