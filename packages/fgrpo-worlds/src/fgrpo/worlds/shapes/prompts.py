"""The ``shapes`` prompt source: a seeded, scene-disjoint train/test split of the grammar."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from fgrpo.core.config import param
from fgrpo.worlds.shapes.world import CATEGORIES, parse_prompt, split


def _check_categories(_instance: Any, _attribute: Any, value: Any) -> None:
    if not value:
        raise ValueError(f"got {value!r}; name at least one of: {', '.join(CATEGORIES)}")
    bad = [c for c in value if c not in CATEGORIES]
    if bad:
        raise ValueError(f"got {value!r}; unknown {', '.join(map(repr, bad))}; allowed: {', '.join(CATEGORIES)}")
    if len(set(value)) != len(value):
        raise ValueError(f"got {value!r}; a category is named twice")


@attrs.define
class ShapesPrompts:
    """Prompts of the shapes world (GenEval-like categories), split by scene so no prompt and no
    rephrasing of a test scene is trained on.

    ``test_prompts()`` has ``min(test_per_category, scenes // 2)`` prompts per category (single has 12
    scenes, so 6), grouped by category. ``train_prompts()`` is shuffled with ``seed``; with ``balance``
    the prompts of smaller categories are repeated so that every category is drawn about equally
    often by a uniform sampler (position has far more prompts than the others).
    ``metadata(prompt)`` = {"category": ..., "spec": Spec.to_dict()} for the ``shapes`` reward.
    """

    seed: int = param(0, help="seed of the train/test split and of the train order")
    test_per_category: int = param(16, ge=1, help="test prompts per category (at most half its scenes)")
    categories: list[str] = param(
        factory=lambda: list(CATEGORIES),
        validator=_check_categories,
        help=f"categories to use, of {', '.join(CATEGORIES)}",
    )
    balance: bool = param(True, help="repeat train prompts so each category is drawn equally often")
    _train: list[str] = attrs.field(init=False, factory=list, repr=False)
    _test: list[str] = attrs.field(init=False, factory=list, repr=False)
    _meta: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        train, self._test = split(self.seed, self.test_per_category, self.categories)
        by_category: dict[str, list[str]] = {}
        for prompt in train:
            by_category.setdefault(self.metadata(prompt)["category"], []).append(prompt)
        if self.balance:
            largest = max(len(v) for v in by_category.values())
            train = [p for v in by_category.values() for p in v * max(1, round(largest / len(v)))]
        order = np.random.default_rng([self.seed, 1]).permutation(len(train))
        self._train = [train[i] for i in order]

    def train_prompts(self) -> list[str]:
        return list(self._train)

    def test_prompts(self) -> list[str]:
        return list(self._test)

    def metadata(self, prompt: str) -> Mapping[str, Any]:
        if prompt not in self._meta:
            spec = parse_prompt(prompt)
            self._meta[prompt] = {"category": spec.category, "spec": spec.to_dict()}
        return self._meta[prompt]
