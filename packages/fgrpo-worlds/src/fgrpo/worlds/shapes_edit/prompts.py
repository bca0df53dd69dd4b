"""The ``shapes-edit`` prompt source: instructions with a rendered source scene each, held-out
instructions per category."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from fgrpo.core.config import param
from fgrpo.core.media import Prompt
from fgrpo.worlds.shapes.world import Scene
from fgrpo.worlds.shapes_edit.world import (
    EDIT_CATEGORIES,
    Edit,
    SceneImage,
    random_source,
    split_instructions,
)


def _check_categories(_instance: Any, _attribute: Any, value: Any) -> None:
    bad = [c for c in value or [] if c not in EDIT_CATEGORIES]
    if not value or bad or len(set(value)) != len(value):
        raise ValueError(f"got {value!r}; allowed: a list of distinct categories of {', '.join(EDIT_CATEGORIES)}")


def make_prompt(edit: Edit, source: Scene) -> Prompt:
    return Prompt(edit.instruction, images=(SceneImage(source),))


@attrs.define
class ShapesEditPrompts:
    """Editing prompts of the shapes world: instructions with a rendered source scene each.

    ``train_prompts()``: ``train_size`` (instruction, source) pairs from the training instructions
    of every category (as many per category); ``test_prompts()``: ``test_per_category`` pairs per
    category from the held-out instructions (:func:`split_instructions`), grouped by category.
    ``metadata(prompt)`` = {"category", "edit", "source"} for the ``shapes-edit`` reward."""

    seed: int = param(0, help="seed of the instruction split and of the source scenes")
    train_size: int = param(1000, ge=1, help="training (instruction, source scene) pairs")
    test_per_category: int = param(16, ge=1, help="held-out pairs per category")
    categories: list[str] = param(
        factory=lambda: list(EDIT_CATEGORIES),
        validator=_check_categories,
        help=f"edit categories, of {', '.join(EDIT_CATEGORIES)}",
    )
    _train: list[str] = attrs.field(init=False, factory=list, repr=False)
    _test: list[str] = attrs.field(init=False, factory=list, repr=False)
    _meta: dict[str, dict[str, Any]] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        train_edits, test_edits = split_instructions(self.seed)
        rng = np.random.default_rng([self.seed, 2626])
        k = len(self.categories)
        for i in range(self.train_size):
            edits = train_edits[self.categories[i % k]]
            self._train.append(self._add(edits[int(rng.integers(len(edits)))], rng))
        for category in self.categories:
            edits = test_edits[category]
            for i in range(self.test_per_category):
                self._test.append(self._add(edits[i % len(edits)], rng))

    def _add(self, edit: Edit, rng: np.random.Generator) -> Prompt:
        source = random_source(edit, rng)
        prompt = make_prompt(edit, source)
        self._meta[prompt] = {
            "category": edit.category,
            "edit": edit.to_dict(),
            "source": SceneImage(source).to_dict(),
        }
        return prompt

    def train_prompts(self) -> list[str]:
        return list(self._train)

    def test_prompts(self) -> list[str]:
        return list(self._test)

    def metadata(self, prompt: str) -> Mapping[str, Any]:
        return self._meta.get(prompt, {})

    @classmethod
    def listed_prompts(cls, values: Mapping[str, Any]) -> list[str]:
        source = cls(**values)
        return source.train_prompts() + source.test_prompts()
