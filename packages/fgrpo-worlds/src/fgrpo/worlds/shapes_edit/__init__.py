"""The shapes-edit world: instructions on a rendered shapes scene (:mod:`.world`), their verifier
and gold metric (:mod:`.verifier`), the prompt source (:mod:`.prompts`), the ``shapes-edit-dit``
policy (:mod:`.model`, diffusers) and its pretraining (``python -m fgrpo.worlds.shapes_edit.pretrain``).

The policy is not imported here: the world, its verifier and prompts need no diffusers."""

from fgrpo.worlds.shapes_edit.prompts import ShapesEditPrompts, make_prompt
from fgrpo.worlds.shapes_edit.verifier import (
    GOLD_DIRECTIONS,
    ShapesEditGoldEvaluator,
    ShapesEditVerifier,
    edit_and_source,
    evaluate,
)
from fgrpo.worlds.shapes_edit.world import (
    ALL_CELLS,
    EDIT_CATEGORIES,
    HELD_OUT,
    POSITIONS,
    Edit,
    SceneImage,
    all_edits,
    applies,
    apply,
    cells_of,
    edit_done,
    edit_pair,
    free_cells,
    mistake,
    parse_instruction,
    random_source,
    scene_codes,
    split_instructions,
    touched_cells,
)

__all__ = [
    "ALL_CELLS",
    "EDIT_CATEGORIES",
    "GOLD_DIRECTIONS",
    "HELD_OUT",
    "POSITIONS",
    "Edit",
    "SceneImage",
    "ShapesEditGoldEvaluator",
    "ShapesEditPrompts",
    "ShapesEditVerifier",
    "all_edits",
    "applies",
    "apply",
    "cells_of",
    "edit_and_source",
    "edit_done",
    "edit_pair",
    "evaluate",
    "free_cells",
    "make_prompt",
    "mistake",
    "parse_instruction",
    "random_source",
    "scene_codes",
    "split_instructions",
    "touched_cells",
]
