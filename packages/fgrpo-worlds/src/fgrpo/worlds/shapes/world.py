"""The shapes world: scene specs, the prompt grammar, the semantics and the renderer.

Everything here is symbolic or pixel-exact; the image-reading verifier lives in
:mod:`fgrpo.worlds.shapes.verifier`, random scenes (pretraining only) in
:mod:`fgrpo.worlds.shapes.scenes`. See the package docstring for the design and its reasons.

Vocabulary
----------
- an *item* is a (colour, shape) pair, e.g. ``("red", "circle")``;
- a *spec* (:class:`Spec`) is what a prompt asks for: its category, the items with their counts
  and, for ``position`` prompts, the relation "objects[0] REL objects[1]";
- a *scene* is a tuple of :class:`Placed` objects (item + grid cell): what an image shows.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

CELL = 8  #: pixels per cell side (= the policy's patch size: one token per cell)
GRID = 3  #: cells per image side
SIZE = CELL * GRID  #: image side in pixels (24)

SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
}
CATEGORIES: tuple[str, ...] = ("single", "two", "counting", "position", "color_attr")
RELATIONS: tuple[str, ...] = ("left", "right", "above", "below")
COUNTS: tuple[int, ...] = (2, 3, 4)  #: counting prompts; "a red circle" (single) covers 1
NUMBER_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three", 4: "four"}
RELATION_WORDS: dict[str, str] = {
    "left": "to the left of",
    "right": "to the right of",
    "above": "above",
    "below": "below",
}
OPPOSITE: dict[str, str] = {"left": "right", "right": "left", "above": "below", "below": "above"}
#: The categories whose words alone do not say the scene (:func:`same_words_other_meaning`).
REBINDABLE: tuple[str, ...] = ("position", "color_attr")

# One fixed 6x6 glyph per shape, centred in its 8x8 cell (1-pixel black margin), given as the
# (first, last) filled column of rows 1..6. Every pair of glyphs differs in exactly 12 pixels,
# so a mask within a few pixels of one template is unambiguous.
_GLYPH_ROWS: dict[str, tuple[tuple[int, int], ...]] = {
    "square": ((1, 6),) * 6,
    "circle": ((3, 4), (2, 5), (1, 6), (1, 6), (2, 5), (3, 4)),
    "triangle": ((3, 4), (3, 4), (2, 5), (2, 5), (1, 6), (1, 6)),
}


def _template(shape: str) -> np.ndarray:
    mask = np.zeros((CELL, CELL), dtype=bool)
    for row, (first, last) in enumerate(_GLYPH_ROWS[shape], start=1):
        mask[row, first : last + 1] = True
    return mask


#: (3, CELL, CELL) bool masks in SHAPES order.
TEMPLATES: np.ndarray = np.stack([_template(s) for s in SHAPES])

Item = tuple[str, str]  # (colour, shape)

#: Items in code order: code k >= 1 of the verifier is ITEMS[k - 1].
ITEMS: tuple[Item, ...] = tuple((c, s) for c in COLORS for s in SHAPES)


def _check_item(color: str, shape: str) -> None:
    if color not in PALETTE:
        raise ValueError(f"unknown colour {color!r}; allowed: {', '.join(COLORS)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; allowed: {', '.join(SHAPES)}")


@attrs.frozen
class Placed:
    """One object of a scene: an item drawn in grid cell (row, col), row 0 at the top."""

    color: str
    shape: str
    row: int
    col: int

    def __attrs_post_init__(self) -> None:
        _check_item(self.color, self.shape)
        if not (0 <= self.row < GRID and 0 <= self.col < GRID):
            raise ValueError(f"cell ({self.row}, {self.col}) outside the {GRID}x{GRID} grid")

    @property
    def item(self) -> Item:
        return (self.color, self.shape)


Scene = tuple[Placed, ...]


@attrs.frozen
class Spec:
    """What a prompt asks for.

    ``objects``: ((colour, shape, count), ...); ``relation`` (position prompts only): objects[0]
    is ``relation`` of objects[1] ("left" = to the left of, by cell column; "above" by cell row).
    """

    category: str
    objects: tuple[tuple[str, str, int], ...]
    relation: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown category {self.category!r}; allowed: {', '.join(CATEGORIES)}")
        for color, shape, count in self.objects:
            _check_item(color, shape)
            if not 1 <= count <= GRID * GRID:
                raise ValueError(f"count {count} outside 1..{GRID * GRID}")
        if (self.relation is None) != (self.category != "position"):
            raise ValueError("a relation is given exactly for position prompts")
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"unknown relation {self.relation!r}; allowed: {', '.join(RELATIONS)}")
        expected = _category_of(self.objects, self.relation)
        if expected != self.category:
            raise ValueError(f"objects {self.objects} with relation {self.relation} make a {expected!r} spec")

    @property
    def required(self) -> Counter:
        """The multiset of items the image must show (and nothing else)."""
        counts: Counter = Counter()
        for color, shape, count in self.objects:
            counts[(color, shape)] += count
        return counts

    @property
    def prompt(self) -> str:
        return prompt_of(self)

    def key(self) -> tuple:
        """The scene this spec denotes, independent of phrasing: "A and B" = "B and A",
        "A right of B" = "B left of A"; used so that no scene is in both train and test."""
        if self.category == "position":
            (a, b), rel = self.objects, self.relation
            if rel in ("right", "below"):
                a, b, rel = b, a, OPPOSITE[rel]
            return ("position", a, b, rel)
        return (self.category, tuple(sorted(self.objects)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "objects": [{"color": c, "shape": s, "count": n} for c, s, n in self.objects],
            "relation": self.relation,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Spec:
        objects = tuple((o["color"], o["shape"], int(o["count"])) for o in data["objects"])
        return cls(category=data["category"], objects=objects, relation=data.get("relation"))


def _category_of(objects: Sequence[tuple[str, str, int]], relation: str | None) -> str:
    if len(objects) == 1:
        if relation is not None:
            raise ValueError("a relation needs two objects")
        return "single" if objects[0][2] == 1 else "counting"
    if len(objects) != 2 or any(n != 1 for _, _, n in objects):
        raise ValueError("two-object prompts name exactly one of each object")
    (ca, sa, _), (cb, sb, _) = objects
    if (ca, sa) == (cb, sb):
        raise ValueError(f"the two objects must differ, got two {ca} {sa}s")
    if relation is not None:
        return "position"
    # GenEval's colour attribution binds two different colours to two different shapes; pairs
    # that share a colour or a shape do not test binding and form the "two" category.
    return "two" if (ca == cb or sa == sb) else "color_attr"


# --- grammar --------------------------------------------------------------------------------------


def _phrase(color: str, shape: str, count: int) -> str:
    return f"a {color} {shape}" if count == 1 else f"{NUMBER_WORDS[count]} {color} {shape}s"


def prompt_of(spec: Spec) -> str:
    """The prompt text of a spec (the inverse of :func:`parse_prompt`)."""
    words = [_phrase(*o) for o in spec.objects]
    if spec.category == "position":
        assert spec.relation is not None  # every position spec has one
        return f"{words[0]} {RELATION_WORDS[spec.relation]} {words[1]}"
    return " and ".join(words)


def same_words_other_meaning(prompt: str) -> dict[str, str]:
    """For a position or colour-binding prompt P: {"same meaning": P's scene in other words ("B OPP
    A"; "a C2 S2 and a C1 S1"), "same words": another scene in P's very words ("B REL A"; the
    colours bound to the other shapes, "a C2 S1 and a C1 S2")}. A bag-of-words reading cannot tell
    P from the second; a reading of the meaning cannot tell it from the first."""
    spec = parse_prompt(prompt)
    if spec.category not in REBINDABLE:
        raise ValueError(
            f"prompt {prompt!r} ({spec.category}): only {' and '.join(REBINDABLE)} prompts have a rebinding"
        )
    first, second = spec.objects
    if spec.category == "position":
        assert spec.relation is not None  # every position spec has one
        paraphrase = attrs.evolve(spec, objects=(second, first), relation=OPPOSITE[spec.relation])
        rebound = attrs.evolve(spec, objects=(second, first))
    else:
        paraphrase = attrs.evolve(spec, objects=(second, first))
        rebound = attrs.evolve(spec, objects=((second[0], *first[1:]), (first[0], *second[1:])))
    return {"same meaning": prompt_of(paraphrase), "same words": prompt_of(rebound)}


def other_arrangements(prompt: str) -> list[str]:
    """For a position prompt "A REL B": the six prompts over the same two objects (either order, any
    relation) that denote another scene than P's, A's first ("A REL' B" for the three other
    relations, then "B REL' A" for the three that are not P's paraphrase "B OPP A"). The hard
    negatives that make a reader attend to the relation word as well as to the order: "A OPP B"
    differs from P in one word, "B REL A" in the order only (both denote the mirrored scene)."""
    spec = parse_prompt(prompt)
    if spec.category != "position":
        raise ValueError(f"prompt {prompt!r} ({spec.category}): only position prompts have arrangements")
    first, second = spec.objects
    candidates = [
        attrs.evolve(spec, objects=pair, relation=r) for pair in (spec.objects, (second, first)) for r in RELATIONS
    ]
    return [prompt_of(c) for c in candidates if c.key() != spec.key()]


_NUM = "|".join(w for w in NUMBER_WORDS.values())
_OBJ = rf"({_NUM}) ({'|'.join(COLORS)}) ({'|'.join(SHAPES)})(s?)"
_REL = "|".join(RELATION_WORDS.values())
_RE_ONE = re.compile(rf"^{_OBJ}$")
_RE_AND = re.compile(rf"^{_OBJ} and {_OBJ}$")
_RE_REL = re.compile(rf"^{_OBJ} ({_REL}) {_OBJ}$")
_WORD_NUMBER = {w: n for n, w in NUMBER_WORDS.items()}
_WORD_RELATION = {w: r for r, w in RELATION_WORDS.items()}


def _obj(groups: Sequence[str], text: str) -> tuple[str, str, int]:
    """(color, shape, count) of an object phrase's four groups: number, color, shape, plural s."""
    number, color, shape, plural = groups
    count = _WORD_NUMBER[number]
    if (count == 1) == bool(plural):
        raise ValueError(f"number and plural disagree in {text!r}")
    return (color, shape, count)


def parse_prompt(prompt: str) -> Spec:
    """Parse a prompt of the grammar into its :class:`Spec` (case, extra spaces and a final full
    stop are tolerated); raise ``ValueError`` naming the prompt if it is not in the grammar."""
    text = " ".join(str(prompt).lower().split()).rstrip(".").strip()
    try:
        if m := _RE_ONE.match(text):
            objects: tuple[tuple[str, str, int], ...] = (_obj(m.groups(), text),)
            return Spec(_category_of(objects, None), objects)
        if m := _RE_AND.match(text):
            g = m.groups()
            objects = (_obj(g[:4], text), _obj(g[4:], text))
            return Spec(_category_of(objects, None), objects)
        if m := _RE_REL.match(text):
            g = m.groups()
            objects = (_obj(g[:4], text), _obj(g[5:], text))
            return Spec("position", objects, _WORD_RELATION[g[4]])
    except ValueError as exc:
        raise ValueError(f"not a shapes prompt: {prompt!r} ({exc})") from None
    raise ValueError(
        f"not a shapes prompt: {prompt!r}; expected e.g. 'a red circle', 'three blue squares', "
        "'a red circle and a blue square', 'a red square to the left of a green circle'"
    )


def all_specs(category: str) -> list[Spec]:
    """Every spec of a category, in a fixed order (both phrasings of two-object scenes)."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; allowed: {', '.join(CATEGORIES)}")
    if category == "single":
        return [Spec("single", ((c, s, 1),)) for c, s in ITEMS]
    if category == "counting":
        return [Spec("counting", ((c, s, n),)) for c, s in ITEMS for n in COUNTS]
    out: list[Spec] = []
    for a, b in itertools.permutations(ITEMS, 2):
        objects = ((*a, 1), (*b, 1))
        if category == "position":
            out.extend(Spec("position", objects, r) for r in RELATIONS)
        elif _category_of(objects, None) == category:
            out.append(Spec(category, objects))
    return out


def all_prompts(categories: Iterable[str] = CATEGORIES) -> list[str]:
    return [s.prompt for c in categories for s in all_specs(c)]


def split(
    seed: int = 0, test_per_category: int = 16, categories: Iterable[str] = CATEGORIES
) -> tuple[list[str], list[str]]:
    """Deterministic disjoint (train, test) prompt lists.

    Per category, scenes (:meth:`Spec.key`, so both phrasings of one scene stay together) are
    shuffled with ``seed``; the first ``min(test_per_category, scenes // 2)`` go to test with one
    randomly chosen phrasing each, the other phrasings of test scenes are dropped, and every
    phrasing of the remaining scenes is a train prompt. Both lists follow the category order and,
    within a category, the order of :func:`all_specs`.
    """
    rng = np.random.default_rng(seed)
    train: list[str] = []
    test: list[str] = []
    for category in categories:
        groups: dict[tuple, list[Spec]] = {}
        for spec in all_specs(category):
            groups.setdefault(spec.key(), []).append(spec)
        keys = list(groups)
        order = rng.permutation(len(keys))
        n_test = min(test_per_category, len(keys) // 2)
        test_keys = {keys[i] for i in order[:n_test]}
        chosen = {k: groups[k][int(rng.integers(len(groups[k])))] for k in (keys[i] for i in order[:n_test])}
        for key, specs in groups.items():
            if key in test_keys:
                test.append(chosen[key].prompt)
            else:
                train.extend(s.prompt for s in specs)
    return train, test


# --- symbolic semantics -----------------------------------------------------------------------------


def cells_in_relation(ca: tuple[int, int], cb: tuple[int, int], relation: str) -> bool:
    return {
        "left": ca[1] < cb[1],
        "right": ca[1] > cb[1],
        "above": ca[0] < cb[0],
        "below": ca[0] > cb[0],
    }[relation]


def relation_holds(scene: Iterable[Placed], a: Item, b: Item, relation: str) -> bool:
    """True iff both items are present and every (a, b) pair of instances is in the relation."""
    cells_a = [(p.row, p.col) for p in scene if p.item == a]
    cells_b = [(p.row, p.col) for p in scene if p.item == b]
    if not cells_a or not cells_b:
        return False
    return all(cells_in_relation(pa, pb, relation) for pa in cells_a for pb in cells_b)


def match(scene: Iterable[Placed], spec: Spec, n_invalid: int = 0) -> tuple[int, int]:
    """(met, total) constraints: the partial score is met / total, success is met == total.

    The multiset Jaccard index of required and drawn items: met = |R ∩ D|; total = |R ∪ D| plus
    one per invalid cell. Position prompts add the relation to both sides (met only when it
    holds). So every required instance is one constraint and every extra object (or unreadable
    cell) adds one unmet "nothing else" constraint.
    """
    scene = tuple(scene)
    required = spec.required
    drawn = Counter(p.item for p in scene)
    met = sum(min(n, drawn[k]) for k, n in required.items())
    total = sum(max(required[k], drawn[k]) for k in set(required) | set(drawn)) + n_invalid
    if spec.relation is not None:
        total += 1
        a, b = (o[:2] for o in spec.objects)
        met += relation_holds(scene, a, b, spec.relation)
    return met, total


def satisfies(scene: Iterable[Placed], spec: Spec) -> bool:
    met, total = match(scene, spec)
    return met == total


# --- rendering --------------------------------------------------------------------------------------


def render(scene: Iterable[Placed]) -> np.ndarray:
    """The exact image of a scene: uint8 array (SIZE, SIZE, 3), glyphs on black."""
    image = np.zeros((SIZE, SIZE, 3), dtype=np.uint8)
    seen = set()
    for p in scene:
        if (p.row, p.col) in seen:
            raise ValueError(f"two objects in cell ({p.row}, {p.col})")
        seen.add((p.row, p.col))
        block = image[p.row * CELL : (p.row + 1) * CELL, p.col * CELL : (p.col + 1) * CELL]
        block[TEMPLATES[SHAPES.index(p.shape)]] = PALETTE[p.color]
    return image


def to_tensor(images: np.ndarray | Sequence[np.ndarray]) -> torch.Tensor:
    """uint8 (H, W, 3) or (B, H, W, 3) arrays as float32 (B, 3, H, W) in [0, 1]."""
    array = np.asarray(images)
    if array.ndim == 3:
        array = array[None]
    return torch.from_numpy(np.ascontiguousarray(array.transpose(0, 3, 1, 2))).float() / 255.0


def render_batch(scenes: Sequence[Iterable[Placed]]) -> torch.Tensor:
    """Float32 (B, 3, SIZE, SIZE) in [0, 1]: the layout the policy produces and rewards receive."""
    if not scenes:
        return torch.zeros(0, 3, SIZE, SIZE)
    return to_tensor(np.stack([render(s) for s in scenes]))
