"""``shapes-edit``: an image-editing world on the shapes world's 3x3 grid that learns on a CPU.

A prompt is an instruction with one source image (a rendered shapes scene,
:class:`SceneImage`, carried by a :class:`fgrpo.core.media.Prompt`); the policy must output the
scene the instruction asks for. Five categories:

- ``color``  "make the red circle blue"                 (36 instructions): the one red circle, recoloured;
- ``count``  "change the number of red circles to three" (48): exactly n of them (added in empty
  cells or removed), as flow_grpo's counting_edit;
- ``add``    "add a red circle"                          (12): one more, in an empty cell;
- ``remove`` "remove the red circle"                     (12): its cell emptied;
- ``move``   "move the red circle to the top left"      (108): its cell emptied, the named (empty)
  cell filled; cells are top left, top, top right, left, middle, right, bottom left, bottom,
  bottom right.

The instruction names an item the source holds exactly once (color, remove, move), or k != n
times (count). Each instruction *touches* a set of cells (:func:`touched_cells`): the cells it may
change. The verifier (:func:`evaluate`) reads the output cell by cell with the shapes verifier's
strict rules and scores, separately,

- ``edit``: the instruction was carried out — the touched cells, all readable, hold exactly what
  the instruction asks (the reward, ``shapes-edit``);
- ``preserved``: every untouched cell reads as in the source, and ``gold_preservation_error``: the
  mean absolute pixel error (0-255) between the output and the source over the untouched cells.
  This is the gold metric RL does not optimise (as ``gold_error`` is for shapes): an editor can
  raise ``edit`` by redrawing the whole picture, which only these two see.

Held out: per category, a seeded set of instructions (:func:`split_instructions`) that neither the
base model's pretraining nor RL ever sees; test prompts pair them with random sources.
Imperfect pretraining pairs (:func:`edit_pair`): with probability ``noise`` the target is a
mistaken edit inside the touched cells (not done, the wrong colour, count or item, a move that
copies): the base learns to make those mistakes and RL has something to fix, while untouched cells
are always copied, so the base preserves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np

from fgrpo.worlds.shapes.verifier import EMPTY, INVALID
from fgrpo.worlds.shapes.world import (
    COLORS,
    GRID,
    ITEMS,
    SHAPES,
    Placed,
    Scene,
    render,
)

EDIT_CATEGORIES: tuple[str, ...] = ("color", "count", "add", "remove", "move")
POSITIONS: dict[str, tuple[int, int]] = {
    "top left": (0, 0),
    "top": (0, 1),
    "top right": (0, 2),
    "left": (1, 0),
    "middle": (1, 1),
    "right": (1, 2),
    "bottom left": (2, 0),
    "bottom": (2, 1),
    "bottom right": (2, 2),
}
EDIT_COUNTS: tuple[int, ...] = (1, 2, 3, 4)
COUNT_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
MAX_OBJECTS = 5  #: the most objects a source scene holds (at least 4 cells stay free or editable)
ALL_CELLS: tuple[tuple[int, int], ...] = tuple((r, c) for r in range(GRID) for c in range(GRID))
Cell = tuple[int, int]
Item = tuple[str, str]


T = TypeVar("T")


def _scene(objects: Iterable[Placed]) -> Scene:
    return tuple(objects)


def given(value: T | None, what: str, category: str) -> T:
    """An edit's argument where the category has one (checked when the edit was made)."""
    if value is None:
        raise ValueError(f"a {category} edit has no {what}")
    return value


@attrs.frozen
class SceneImage:
    """A source image that is a rendered scene: hashable (a prompt's identity), picklable, and an
    image reference :func:`fgrpo.core.media.load_image` opens (``to_pil``)."""

    scene: Scene = attrs.field(converter=_scene)

    def to_pil(self) -> Any:
        from PIL import Image

        return Image.fromarray(render(self.scene))

    def to_dict(self) -> list[dict[str, Any]]:
        return [attrs.asdict(p) for p in self.scene]

    @classmethod
    def from_dict(cls, data: Sequence[Mapping[str, Any]]) -> SceneImage:
        return cls(tuple(Placed(**p) for p in data))


@attrs.frozen
class Edit:
    """What an instruction asks: its category, the item it names and the category's argument
    (``new_color``, ``count`` or ``position``)."""

    category: str
    item: Item
    new_color: str | None = None
    count: int | None = None
    position: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.category not in EDIT_CATEGORIES:
            raise ValueError(f"unknown edit category {self.category!r}; allowed: {', '.join(EDIT_CATEGORIES)}")
        color, shape = self.item
        if color not in COLORS or shape not in SHAPES:
            raise ValueError(f"unknown item {self.item!r}")
        wanted = {"color": "new_color", "count": "count", "move": "position"}.get(self.category)
        for name in ("new_color", "count", "position"):
            if (getattr(self, name) is not None) != (name == wanted):
                raise ValueError(f"a {self.category} edit {'needs' if name == wanted else 'takes no'} {name}")
        if self.new_color is not None and (self.new_color not in COLORS or self.new_color == color):
            raise ValueError(f"new colour {self.new_color!r} must be another of {', '.join(COLORS)}")
        if self.count is not None and self.count not in EDIT_COUNTS:
            raise ValueError(f"count {self.count}; allowed: {EDIT_COUNTS}")
        if self.position is not None and self.position not in POSITIONS:
            raise ValueError(f"position {self.position!r}; allowed: {', '.join(POSITIONS)}")

    @property
    def instruction(self) -> str:
        color, shape = self.item
        if self.category == "color":
            return f"make the {color} {shape} {self.new_color}"
        if self.category == "count":
            return f"change the number of {color} {shape}s to {COUNT_WORDS[given(self.count, 'count', self.category)]}"
        if self.category == "add":
            return f"add a {color} {shape}"
        if self.category == "remove":
            return f"remove the {color} {shape}"
        return f"move the {color} {shape} to the {self.position}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None} | {"item": list(self.item)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Edit:
        return cls(**{**data, "item": tuple(data["item"])})


def parse_instruction(text: str) -> Edit:
    """The :class:`Edit` of an instruction of the grammar (case, spaces, a final full stop
    tolerated); ValueError naming the text otherwise."""
    words = " ".join(str(text).lower().split()).rstrip(".").split()
    try:
        if words[:2] == ["make", "the"] and len(words) == 5:
            return Edit("color", (words[2], words[3]), new_color=words[4])
        if (
            words[:4] == ["change", "the", "number", "of"]
            and len(words) == 8
            and words[6] == "to"
            and words[5].endswith("s")
        ):
            count = {w: n for n, w in COUNT_WORDS.items()}[words[7]]
            return Edit("count", (words[4], words[5][:-1]), count=count)
        if words[:2] == ["add", "a"] and len(words) == 4:
            return Edit("add", (words[2], words[3]))
        if words[:2] == ["remove", "the"] and len(words) == 4:
            return Edit("remove", (words[2], words[3]))
        if words[:2] == ["move", "the"] and words[4:6] == ["to", "the"] and len(words) in (7, 8):
            return Edit("move", (words[2], words[3]), position=" ".join(words[6:]))
    except (KeyError, ValueError, IndexError):
        pass
    raise ValueError(
        f"not a shapes-edit instruction: {text!r}; expected e.g. 'make the red circle blue', 'change the number of "
        "red circles to three', 'add a red circle', 'remove the red circle', 'move the red circle to the top left'"
    )


def all_edits(category: str) -> list[Edit]:
    """Every edit of a category, in a fixed order."""
    if category == "color":
        return [Edit("color", it, new_color=c) for it in ITEMS for c in COLORS if c != it[0]]
    if category == "count":
        return [Edit("count", it, count=n) for it in ITEMS for n in EDIT_COUNTS]
    if category in ("add", "remove"):
        return [Edit(category, it) for it in ITEMS]
    if category == "move":
        return [Edit("move", it, position=p) for it in ITEMS for p in POSITIONS]
    raise ValueError(f"unknown edit category {category!r}; allowed: {', '.join(EDIT_CATEGORIES)}")


#: held-out instructions per category (of 36, 48, 12, 12, 108)
HELD_OUT: dict[str, int] = {"color": 6, "count": 8, "add": 3, "remove": 3, "move": 12}


def split_instructions(
    seed: int = 0, held_out: Mapping[str, int] = HELD_OUT
) -> tuple[dict[str, list[Edit]], dict[str, list[Edit]]]:
    """(train, test) edits per category: ``held_out[category]`` seeded instructions are test-only."""
    rng = np.random.default_rng([seed, 26])
    train, test = {}, {}
    for category in EDIT_CATEGORIES:
        edits = all_edits(category)
        order = rng.permutation(len(edits))
        n = held_out.get(category, 0)
        test[category] = [edits[i] for i in sorted(order[:n])]
        train[category] = [edits[i] for i in sorted(order[n:])]
    return train, test


# --- the semantics --------------------------------------------------------------------------------


def cells_of(scene: Scene, item: Item) -> list[Cell]:
    return [(p.row, p.col) for p in scene if p.item == item]


def free_cells(scene: Scene) -> list[Cell]:
    used = {(p.row, p.col) for p in scene}
    return [c for c in ALL_CELLS if c not in used]


def applies(edit: Edit, scene: Scene) -> bool:
    """Whether the instruction makes sense for the source: its item there once (color, remove,
    move; the move's cell empty), k != n times with room for n (count), a free cell (add)."""
    held = cells_of(scene, edit.item)
    free = free_cells(scene)
    if edit.category in ("color", "remove"):
        return len(held) == 1
    if edit.category == "move":
        return len(held) == 1 and POSITIONS[given(edit.position, "position", edit.category)] in free
    if edit.category == "count":
        count = given(edit.count, "count", edit.category)
        return 1 <= len(held) != count and count - len(held) <= len(free)
    return bool(free)


def touched_cells(edit: Edit, source: Scene) -> frozenset[Cell]:
    """The cells the instruction may change: the item's cell (color, remove), its cell and the
    destination (move), the item's cells and every free cell (count), every free cell (add)."""
    held, free = cells_of(source, edit.item), free_cells(source)
    if edit.category in ("color", "remove"):
        return frozenset(held)
    if edit.category == "move":
        return frozenset(held + [POSITIONS[given(edit.position, "position", edit.category)]])
    if edit.category == "count":
        return frozenset(held + free)
    return frozenset(free)


def apply(edit: Edit, source: Scene, rng: np.random.Generator) -> Scene:
    """A correct result (random cells where the instruction leaves the choice: add, count)."""
    color, shape = edit.item
    held, free = cells_of(source, edit.item), free_cells(source)
    others = tuple(p for p in source if p.item != edit.item)
    if edit.category == "color":
        return tuple(
            attrs.evolve(p, color=given(edit.new_color, "new colour", edit.category)) if p.item == edit.item else p
            for p in source
        )
    if edit.category == "remove":
        return others
    if edit.category == "move":
        return others + (Placed(color, shape, *POSITIONS[given(edit.position, "position", edit.category)]),)
    if edit.category == "add":
        cell = free[int(rng.integers(len(free)))]
        return tuple(source) + (Placed(color, shape, *cell),)
    # count: keep a random subset of the item's cells, or add in random free cells
    n = given(edit.count, "count", edit.category)
    if n < len(held):
        keep = [held[i] for i in sorted(rng.permutation(len(held))[:n])]
        return others + tuple(Placed(color, shape, *c) for c in keep)
    extra = [free[i] for i in rng.permutation(len(free))[: n - len(held)]]
    return tuple(source) + tuple(Placed(color, shape, *c) for c in extra)


def mistake(edit: Edit, source: Scene, rng: np.random.Generator) -> Scene:
    """A wrong result that changes only touched cells: the edit not done, or done wrongly (another
    colour, a count off by one, another item added, a move that copies instead of moving)."""
    if rng.random() < 0.5:
        return tuple(source)
    color, shape = edit.item
    if edit.category == "color":
        wrong = [c for c in COLORS if c not in (color, edit.new_color)]
        return apply(attrs.evolve(edit, new_color=wrong[int(rng.integers(len(wrong)))]), source, rng)
    if edit.category == "count":
        count = given(edit.count, "count", edit.category)
        options = [n for n in (count - 1, count + 1) if n in EDIT_COUNTS and n != len(cells_of(source, edit.item))]
        options = [n for n in options if n - len(cells_of(source, edit.item)) <= len(free_cells(source))]
        if not options:
            return tuple(source)
        return apply(attrs.evolve(edit, count=options[int(rng.integers(len(options)))]), source, rng)
    if edit.category == "add":
        others = [it for it in ITEMS if it != edit.item and (it[0] == color or it[1] == shape)]
        return apply(attrs.evolve(edit, item=others[int(rng.integers(len(others)))]), source, rng)
    if edit.category == "move":
        return tuple(source) + (Placed(color, shape, *POSITIONS[given(edit.position, "position", edit.category)]),)
    return tuple(source)  # remove: not removed


def random_source(edit: Edit, rng: np.random.Generator) -> Scene:
    """A random source scene the instruction applies to (1 to MAX_OBJECTS objects)."""
    for _ in range(1000):
        held = (
            int(rng.integers(1, 4))
            if edit.category == "count"
            else int(rng.integers(0, 3))
            if edit.category == "add"
            else 1
        )
        others = int(rng.integers(0 if edit.category != "add" or held else 1, MAX_OBJECTS - held + 1))
        cells = [ALL_CELLS[i] for i in rng.permutation(len(ALL_CELLS))[: held + others]]
        choices = [it for it in ITEMS if it != edit.item]
        scene = tuple(Placed(*edit.item, *c) for c in cells[:held]) + tuple(
            Placed(*choices[int(rng.integers(len(choices)))], *c) for c in cells[held:]
        )
        if scene and applies(edit, scene):
            return scene
    raise RuntimeError(f"no source scene for {edit.instruction!r}")  # pragma: no cover


def edit_pair(edit: Edit, rng: np.random.Generator, noise: float = 0.0) -> tuple[Scene, Scene]:
    """(source, target) for pretraining: a random source and the correct result, or with
    probability ``noise`` a :func:`mistake` (the imperfect pairs the base model learns from)."""
    source = random_source(edit, rng)
    target = mistake(edit, source, rng) if rng.random() < noise else apply(edit, source, rng)
    return source, target


# --- the verifier -----------------------------------------------------------------------------------


def scene_codes(scene: Scene) -> np.ndarray:
    codes = np.zeros((GRID, GRID), dtype=np.int64)
    for p in scene:
        codes[p.row, p.col] = 1 + ITEMS.index(p.item)
    return codes


def edit_done(edit: Edit, source: Scene, codes: np.ndarray) -> bool:
    """Whether output cell codes (GRID, GRID) carry out the instruction on its touched cells."""
    touched = touched_cells(edit, source)
    if any(codes[c] == INVALID for c in touched):
        return False
    item = 1 + ITEMS.index(edit.item)
    if edit.category == "color":
        (cell,) = touched
        return codes[cell] == 1 + ITEMS.index((edit.new_color, edit.item[1]))
    if edit.category == "remove":
        (cell,) = touched
        return codes[cell] == EMPTY
    if edit.category == "move":
        (origin,) = cells_of(source, edit.item)
        return codes[origin] == EMPTY and codes[POSITIONS[given(edit.position, "position", edit.category)]] == item
    values = Counter(int(codes[c]) for c in touched)
    if set(values) - {EMPTY, item}:
        return False
    return values[item] == (edit.count if edit.category == "count" else 1)
