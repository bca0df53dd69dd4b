"""The shapes-edit world's verifier (the ``shapes-edit`` reward) and its gold metric (the
``shapes-edit-gold`` evaluator): was the instruction's edit carried out on the cells it touches,
and were the untouched cells preserved."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np
import torch

from fgrpo.core.config import param
from fgrpo.core.media import source_images
from fgrpo.core.protocols import EvaluatorResult, RewardResult
from fgrpo.core.scoring import detail_means
from fgrpo.worlds.shapes.verifier import EMPTY, GLYPH_TOLERANCE, PIXEL_TOLERANCE, read_cells
from fgrpo.worlds.shapes.world import CELL, GRID, ITEMS, Scene, render_batch
from fgrpo.worlds.shapes_edit.world import (
    ALL_CELLS,
    Edit,
    SceneImage,
    apply,
    cells_of,
    edit_done,
    given,
    parse_instruction,
    scene_codes,
    touched_cells,
)


def evaluate(
    images: torch.Tensor,
    edits: Sequence[Edit],
    sources: Sequence[Scene],
    pixel_tolerance: float = PIXEL_TOLERANCE,
    glyph_tolerance: int = GLYPH_TOLERANCE,
) -> dict[str, Any]:
    """Per image (B,): ``edit`` (0/1), ``preserved`` (0/1), ``preserved_cells`` (fraction of
    untouched cells read as in the source), ``gold_preservation_error`` (mean |output - source| in
    0-255 over the untouched cells' pixels; 0 when the instruction touches every cell), ``clean``,
    ``category``, ``read``, ``passed`` (the world's pass rule: the edit done and every untouched
    cell preserved) and ``marks`` (boxes for the report to outline: the cells a colour, remove or
    move edit targets; the cells an add or count edit changed, which may be any free cell)."""
    if not (len(edits) == len(sources) == images.shape[0]):
        raise ValueError(f"{images.shape[0]} images, {len(edits)} edits, {len(sources)} sources")
    reading = read_cells(images, pixel_tolerance, glyph_tolerance)
    pixels = images.detach().float().clamp(0, 1).cpu() * 255.0
    source_pixels = render_batch(list(sources)) * 255.0
    diff = (pixels - source_pixels).abs().mean(1)  # (B, H, W)
    cell_error = diff.reshape(-1, GRID, CELL, GRID, CELL).mean((2, 4))  # (B, GRID, GRID)
    done, preserved, cells, error, marks = [], [], [], [], []
    for b, (edit, source) in enumerate(zip(edits, sources, strict=True)):
        codes = reading.codes[b].numpy()
        touched = touched_cells(edit, source)
        untouched = [c for c in ALL_CELLS if c not in touched]
        expected = scene_codes(source)
        # an add or a count may use any free cell: outline the ones the output changed, not all nine
        shown = (
            touched
            if edit.category in ("color", "remove", "move")
            else {c for c in touched if codes[c] != expected[c]}
        )
        marks.append([[col / GRID, row / GRID, (col + 1) / GRID, (row + 1) / GRID] for row, col in sorted(shown)])
        same = [codes[c] == expected[c] for c in untouched]
        done.append(float(edit_done(edit, source, codes)))
        preserved.append(float(all(same)))
        cells.append(float(np.mean(same)) if same else 1.0)
        error.append(float(np.mean([cell_error[b][c].item() for c in untouched])) if untouched else 0.0)
    return {
        "edit": torch.tensor(done),
        "preserved": torch.tensor(preserved),
        "preserved_cells": torch.tensor(cells),
        "gold_preservation_error": torch.tensor(error),
        "clean": reading.clean.float(),
        "category": [e.category for e in edits],
        "read": [reading.describe(b) for b in range(len(edits))],
        "passed": torch.tensor(done).bool() & torch.tensor(preserved).bool(),
        "marks": marks,
    }


def edit_and_source(prompt: str, metadata: Mapping[str, Any] | None) -> tuple[Edit, Scene]:
    """The edit and source scene of a prompt: its metadata (``edit``, ``source``) when given, else
    the instruction parsed and the scene of its :class:`SceneImage`."""
    if metadata and "edit" in metadata and "source" in metadata:
        return Edit.from_dict(metadata["edit"]), SceneImage.from_dict(metadata["source"]).scene
    images = [ref for ref in source_images(prompt) if isinstance(ref, SceneImage)]
    if len(images) != 1:
        raise ValueError(
            f"shapes-edit: prompt {str(prompt)!r} has no shapes scene as its source image (metadata 'source')"
        )
    return parse_instruction(prompt), images[0].scene


@attrs.define
class ShapesEditVerifier:
    """The ``shapes-edit`` reward: 1 when the instruction was carried out on the cells it touches
    (``score: strict``), or ``partial``: the fraction of touched cells that read as the correct
    result would (a count or add edit counts the item instances instead). Preservation of the
    untouched cells is reported (``preserved``, ``gold_preservation_error``), never rewarded."""

    category_noun = "edit kind"

    score: Literal["strict", "partial"] = param(
        "strict", choices=("strict", "partial"), help="strict: 0/1 edit done; partial: graded"
    )
    pixel_tolerance: float = param(PIXEL_TOLERANCE, ge=0.0, le=127.0, help="as for the shapes reward")
    glyph_tolerance: int = param(GLYPH_TOLERANCE, ge=0, le=5, help="as for the shapes reward")

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        pairs = [edit_and_source(p, m) for p, m in zip(prompts, metadata, strict=True)]
        details = evaluate(
            outputs, [e for e, _ in pairs], [s for _, s in pairs], self.pixel_tolerance, self.glyph_tolerance
        )
        scores = details["edit"] if self.score == "strict" else self._partial(outputs, pairs, details)
        return RewardResult(scores=scores.float().to(outputs.device), details=details)

    def _partial(
        self, outputs: torch.Tensor, pairs: Sequence[tuple[Edit, Scene]], details: Mapping[str, Any]
    ) -> torch.Tensor:
        codes = read_cells(outputs, self.pixel_tolerance, self.glyph_tolerance).codes.numpy()
        out = []
        for b, (edit, source) in enumerate(pairs):
            touched = sorted(touched_cells(edit, source))
            if edit.category in ("count", "add"):
                want = (
                    given(edit.count, "count", "count")
                    if edit.category == "count"
                    else len(cells_of(source, edit.item)) + 1
                )
                item = 1 + ITEMS.index(edit.item)
                have = sum(int(codes[b][c] == item) for c in ALL_CELLS)
                wrong = sum(int(codes[b][c] not in (EMPTY, item)) for c in touched)
                out.append(max(0.0, 1.0 - (abs(have - want) + wrong) / max(1, want)))
                continue
            expected = scene_codes(apply(edit, source, np.random.default_rng(0)))
            out.append(float(np.mean([codes[b][c] == expected[c] for c in touched])))
        partial = torch.tensor(out)
        return torch.where(details["edit"] > 0, torch.ones_like(partial), torch.clamp(partial, max=0.99))


#: the gold metrics and which way is better
GOLD_DIRECTIONS = {"preserved": "higher", "preserved_cells": "higher", "gold_preservation_error": "lower"}


@attrs.define
class ShapesEditGoldEvaluator:
    """The shapes-edit world's GOLD metric as an evaluator (``evaluator: shapes-edit-gold``): over
    the very samples the evaluation scored, ``preserved`` (every untouched cell reads as in the
    source), ``preserved_cells`` and ``gold_preservation_error`` (:func:`evaluate`), overall and
    per edit category; with the same tolerances they equal the ``eval/shapes-edit/...`` details
    the reward reports beside its score. RL does not optimise them, so ``eval.guard`` may watch
    them (``gold/shapes-edit-gold/preserved``)."""

    pixel_tolerance: float = param(PIXEL_TOLERANCE, ge=0.0, le=127.0, help="as for the shapes-edit reward")
    glyph_tolerance: int = param(GLYPH_TOLERANCE, ge=0, le=5, help="as for the shapes-edit reward")

    directions = GOLD_DIRECTIONS
    category_noun = "edit kind"
    limits = {"preserved": 0.01}

    def __call__(self, context: Any) -> EvaluatorResult:
        pairs = [edit_and_source(p, context.metadata(p)) for p in context.sample_prompts]
        details = evaluate(
            context.samples, [e for e, _ in pairs], [s for _, s in pairs], self.pixel_tolerance, self.glyph_tolerance
        )
        # averaged as the evaluation averages the reward's details (per category, and their mean)
        metrics = detail_means({key: details[key] for key in (*GOLD_DIRECTIONS, "category")})
        return EvaluatorResult(metrics=metrics)
