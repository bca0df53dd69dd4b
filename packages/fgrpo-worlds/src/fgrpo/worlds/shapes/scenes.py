"""Random scenes of the shapes world, for pretraining: a uniformly placed scene that satisfies a
prompt, and one made wrong by a single mistake (caption noise).

Only the pretraining of the base model (``fgrpo.worlds.shapes.pretrain``) and tests sample scenes;
the rewards and the prompt source never do.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from fgrpo.worlds.shapes.world import (
    COLORS,
    GRID,
    RELATIONS,
    SHAPES,
    Placed,
    Scene,
    Spec,
    cells_in_relation,
    parse_prompt,
    render_batch,
    satisfies,
)

ALL_CELLS: tuple[tuple[int, int], ...] = tuple((r, c) for r in range(GRID) for c in range(GRID))
PERTURBATIONS: tuple[str, ...] = ("count", "color", "shape", "position", "binding")


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _as_spec(prompt: str | Spec) -> Spec:
    return prompt if isinstance(prompt, Spec) else parse_prompt(prompt)


#: (relation, holds) -> every ordered pair of distinct cells for which the relation holds / fails.
_PAIRS: dict[tuple[str, bool], list[tuple[tuple[int, int], tuple[int, int]]]] = {
    (rel, holds): [
        (ca, cb) for ca, cb in itertools.permutations(ALL_CELLS, 2) if cells_in_relation(ca, cb, rel) == holds
    ]
    for rel in RELATIONS
    for holds in (True, False)
}


def relation_pairs(relation: str, holds: bool = True) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Every ordered pair of distinct cells (cell_a, cell_b) for which "a ``relation`` b" holds (or,
    with ``holds`` False, fails): :func:`place` draws a position scene's cells uniformly from it."""
    return list(_PAIRS[(relation, holds)])


def relation_scenes(prompt: Spec | str) -> list[Scene]:
    """Every scene of a position prompt: its two objects in each ordered pair of distinct cells in
    the relation (:func:`place` draws one of them uniformly)."""
    spec = _as_spec(prompt)
    if spec.relation is None:
        raise ValueError(f"{spec.prompt!r} is not a position prompt")
    (ca, sa, _), (cb, sb, _) = spec.objects
    return [(Placed(ca, sa, *a), Placed(cb, sb, *b)) for a, b in _PAIRS[(spec.relation, True)]]


def _pair_cells(relation: str, rng: np.random.Generator, holds: bool = True):
    pairs = _PAIRS[(relation, holds)]
    return pairs[int(rng.integers(len(pairs)))]


def place(spec: Spec | str, rng: np.random.Generator | int | None = None) -> Scene:
    """A uniformly random scene that satisfies the spec (random distinct cells)."""
    spec, rng = _as_spec(spec), _rng(rng)
    if spec.relation is not None:
        (ca, sa, _), (cb, sb, _) = spec.objects
        cell_a, cell_b = _pair_cells(spec.relation, rng)
        return (Placed(ca, sa, *cell_a), Placed(cb, sb, *cell_b))
    items = [(c, s) for c, s, n in spec.objects for _ in range(n)]
    cells = rng.permutation(len(ALL_CELLS))[: len(items)]
    return tuple(Placed(c, s, *ALL_CELLS[i]) for (c, s), i in zip(items, cells, strict=True))


def perturbations_for(spec: Spec) -> tuple[str, ...]:
    """The caption-noise kinds that apply to a spec."""
    kinds = ["count", "color", "shape"]
    if spec.category == "position":
        kinds.append("position")
    if spec.category == "color_attr":
        kinds.append("binding")
    return tuple(kinds)


def perturb(
    scene: Scene, spec: Spec | str, rng: np.random.Generator | int | None = None, kind: str | None = None
) -> Scene:
    """A scene that does NOT satisfy ``spec``, made from ``scene`` by one mistake of ``kind``
    (random among :func:`perturbations_for` when None):

    - ``count``: one object fewer or one more (single prompts: always one more copy);
    - ``color`` / ``shape``: every instance of one required item gets another colour / shape;
    - ``position`` (position prompts): the two objects re-placed where the relation fails
      (reversed, or level on that axis);
    - ``binding`` (color_attr prompts): the two objects swap colours.
    """
    spec, rng = _as_spec(spec), _rng(rng)
    allowed = perturbations_for(spec)
    if kind is not None and kind not in allowed:
        raise ValueError(f"perturbation {kind!r} does not apply to {spec.category!r}; allowed: {', '.join(allowed)}")
    for _ in range(100):
        k = kind if kind is not None else allowed[int(rng.integers(len(allowed)))]
        out = _perturb_once(tuple(scene), spec, rng, k)
        if out is not None and not satisfies(out, spec):
            return out
    raise RuntimeError(f"could not perturb {spec.prompt!r} with {kind!r}")  # pragma: no cover


def _perturb_once(scene: Scene, spec: Spec, rng: np.random.Generator, kind: str) -> Scene | None:
    if kind == "count":
        used = {(p.row, p.col) for p in scene}
        free = [c for c in ALL_CELLS if c not in used]
        remove = len(scene) > 1 and (not free or rng.random() < 0.5)
        if remove:
            drop = int(rng.integers(len(scene)))
            return tuple(p for i, p in enumerate(scene) if i != drop)
        if not free:
            return None
        src = scene[int(rng.integers(len(scene)))]
        cell = free[int(rng.integers(len(free)))]
        return scene + (Placed(src.color, src.shape, *cell),)
    if kind in ("color", "shape"):
        color, shape, _ = spec.objects[int(rng.integers(len(spec.objects)))]
        if kind == "color":
            options = [c for c in COLORS if c != color]
            new = options[int(rng.integers(len(options)))]
            return tuple(attrs.evolve(p, color=new) if p.item == (color, shape) else p for p in scene)
        options = [s for s in SHAPES if s != shape]
        new = options[int(rng.integers(len(options)))]
        return tuple(attrs.evolve(p, shape=new) if p.item == (color, shape) else p for p in scene)
    if kind == "position":
        (ca, sa, _), (cb, sb, _) = spec.objects
        assert spec.relation is not None  # every position spec has one
        cell_a, cell_b = _pair_cells(spec.relation, rng, holds=False)
        return (Placed(ca, sa, *cell_a), Placed(cb, sb, *cell_b))
    if kind == "binding":
        (ca, sa, _), (cb, sb, _) = spec.objects
        swap = {(ca, sa): cb, (cb, sb): ca}
        return tuple(attrs.evolve(p, color=swap.get(p.item, p.color)) for p in scene)
    raise ValueError(f"unknown perturbation {kind!r}; allowed: {', '.join(PERTURBATIONS)}")


def sample_scene(
    prompt: str | Spec, rng: np.random.Generator | int | None = None, caption_noise: float = 0.0
) -> Scene:
    """A random scene for a prompt (a pretraining pair is (prompt, render(scene))).

    With probability ``caption_noise`` the scene is instead made wrong by one :func:`perturb`
    mistake while the caption stays the same (the noisy-caption pretraining that makes the base
    model imperfect in the compositional way RL can fix).
    """
    if not 0.0 <= caption_noise <= 1.0:
        raise ValueError(f"caption_noise must be in [0, 1], got {caption_noise!r}")
    spec, rng = _as_spec(prompt), _rng(rng)
    scene = place(spec, rng)
    if rng.random() < caption_noise:
        scene = perturb(scene, spec, rng)
    return scene


def sample_images(
    prompts: Sequence[str | Spec], rng: np.random.Generator | int | None = None, caption_noise: float = 0.0
) -> torch.Tensor:
    """One random scene per prompt, rendered: float32 (B, 3, SIZE, SIZE) in [0, 1]."""
    rng = _rng(rng)
    return render_batch([sample_scene(p, rng, caption_noise) for p in prompts])
