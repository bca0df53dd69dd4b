"""The shapes world: a GenEval-like compositional text-to-image task that learns on a laptop CPU.

Design (chosen by measurement on a prototype: free-form blobs left a tiny model stuck on
drawing, cell-aligned glyphs let it draw clean objects within minutes so that its remaining
errors are compositional - what RL should fix):

- Image: RGB 24x24 on black = a 3x3 grid of 8x8 cells. With the policy's patch size 8 each cell
  is one token: 9 image tokens (attention cost grows with their square; 4x4 cells would cost
  1.8x (MLP) to 3.2x (attention) per layer) and 1728 pixel dims per image, the set-up the prototype
  measured. Nine cells hold the largest scene (four objects) with room for wrong extras.
- Objects: one fixed 6x6 glyph per shape centred in its cell with a 1-pixel black margin: square
  (36 px), circle (rows 2-4-6-6-4-2, 24 px), triangle (rows 2-2-4-4-6-6, 24 px); any two glyphs
  differ in exactly 12 pixels. Pure colours red, green, blue, yellow.
- Prompts (:mod:`.world`): ``single`` "a red circle" (12); ``counting`` "three blue circles",
  counts 2-4 (36); ``two`` two objects sharing a colour or a shape, "a red circle and a red
  square" (60 phrasings of 30 scenes); ``color_attr`` two objects differing in both, so colours
  must bind to the right shapes, "a green triangle and a yellow square" (72 / 36); ``position``
  "a red square to the left of a green circle", left/right by cell column, above/below by cell
  row (528 / 264). :func:`split` keeps every phrasing of a scene on one side.
- Verifier (:mod:`.verifier`): strict per-cell parsing that rejects off-palette pixels (> 20 from
  black and every palette colour), mixed colours and glyphs more than 2 pixels off their template;
  partial credit = multiset Jaccard of required vs drawn objects (+ the relation); strict
  accuracy; and the GOLD metric (mean absolute error to a clean re-render) that exposes drift.

Public API for tools and recipes: :func:`render`, :func:`render_batch`, :func:`sample_scene`,
:func:`sample_images`, :func:`perturb`, :func:`place`, :func:`parse_prompt`, :func:`split`,
:func:`read_cells`, :func:`evaluate`, :func:`gold_error`; components ``ShapesVerifier``
(reward ``shapes``), ``ShapesGold`` (``shapes-gold``) and ``ShapesPrompts`` (prompts ``shapes``).
"""

from fgrpo.worlds.shapes.prompts import ShapesPrompts
from fgrpo.worlds.shapes.scenes import PERTURBATIONS, perturb, place, sample_images, sample_scene
from fgrpo.worlds.shapes.verifier import (
    GLYPH_TOLERANCE,
    PIXEL_TOLERANCE,
    Reading,
    ShapesGold,
    ShapesVerifier,
    evaluate,
    gold_error,
    read_cells,
)
from fgrpo.worlds.shapes.world import (
    CATEGORIES,
    CELL,
    COLORS,
    GRID,
    PALETTE,
    REBINDABLE,
    RELATIONS,
    SHAPES,
    SIZE,
    Placed,
    Scene,
    Spec,
    all_prompts,
    all_specs,
    match,
    other_arrangements,
    parse_prompt,
    prompt_of,
    render,
    render_batch,
    same_words_other_meaning,
    satisfies,
    split,
    to_tensor,
)

__all__ = [
    "CATEGORIES",
    "CELL",
    "COLORS",
    "GLYPH_TOLERANCE",
    "GRID",
    "PALETTE",
    "PERTURBATIONS",
    "PIXEL_TOLERANCE",
    "Placed",
    "REBINDABLE",
    "RELATIONS",
    "Reading",
    "SHAPES",
    "SIZE",
    "Scene",
    "ShapesGold",
    "ShapesPrompts",
    "ShapesVerifier",
    "Spec",
    "all_prompts",
    "all_specs",
    "evaluate",
    "gold_error",
    "match",
    "other_arrangements",
    "parse_prompt",
    "perturb",
    "place",
    "prompt_of",
    "read_cells",
    "render",
    "render_batch",
    "sample_images",
    "sample_scene",
    "same_words_other_meaning",
    "satisfies",
    "split",
    "to_tensor",
]
