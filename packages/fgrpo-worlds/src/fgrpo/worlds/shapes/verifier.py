"""Reading a shapes image cell by cell, the ``shapes`` reward and the ``shapes-gold`` metric.

Rules (all distances in 0-255 units; images arrive as float (B, 3, 24, 24) in [0, 1]):

1. Pixel: its nearest reference colour among black and the 4 palette colours by the largest
   per-channel difference (L-infinity). A pixel farther than ``pixel_tolerance`` (default 20)
   from all five is *off-palette*.
2. Cell (8x8, one per token), in this order:
   - any off-palette pixel                                     -> INVALID (off-palette);
   - every pixel near black                                    -> EMPTY;
   - non-black pixels snapped to more than one palette colour  -> INVALID (mixed colours);
   - the non-black mask differs from the nearest glyph template (square, circle, triangle,
     each 6x6 centred; any two differ in 12 pixels) in more than ``glyph_tolerance`` pixels
     (default 2), margin pixels included                       -> INVALID (broken glyph);
   - otherwise the object (that colour, that shape).
   An image is *clean* when no cell is INVALID.
3. Score: see :func:`fgrpo.worlds.shapes.world.match`: partial = met / total constraints (the
   multiset Jaccard of required and drawn objects, each INVALID cell one more unmet constraint,
   position prompts add the relation); accuracy = 1 iff met == total, which implies a clean image.
   So partial == 1 exactly when accuracy == 1: the partial reward has the same optimum as the
   strict one, with graded credit (counts off by one, one of two objects right, the relation)
   instead of 0/1 groups that are often all-equal.

Why these thresholds: the feasibility notes saw RL drift, under a verifier that snapped pixels to
the palette, to faint speckle and colour shifts (mean error 8 -> 21-24) until glyphs broke. Here
speckle brighter than 20, a channel shift over 20 (red drawn as (230, 20, 20) is 25 away) and a
glyph with 3 or more wrong pixels each make a cell unreadable, which costs reward; the continuous
output's small noise (a few units) is tolerated. Drift below the tolerance is invisible to the
reward but not to the GOLD metric: the mean absolute pixel error between the image and a clean
re-render of what was read (readable cells re-rendered as read; an INVALID cell against the
nearest of the 13 clean cells - empty or one of the 12 objects - in mean absolute error, i.e. its
distance to anything clean).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np
import torch

from fgrpo.core.config import param
from fgrpo.core.protocols import EvaluatorResult, RewardResult
from fgrpo.core.scoring import detail_means
from fgrpo.worlds.shapes.world import (
    CATEGORIES,
    CELL,
    COLORS,
    GRID,
    ITEMS,
    PALETTE,
    SHAPES,
    SIZE,
    TEMPLATES,
    Placed,
    Spec,
    match,
    parse_prompt,
)

PIXEL_TOLERANCE = 20.0
GLYPH_TOLERANCE = 2

INVALID = -1  #: cell code of an unreadable cell; 0 = empty; k >= 1 = ITEMS[k - 1]
EMPTY = 0
#: why a cell is INVALID (``Reading.reasons``); 0 where it is readable
REASONS = {1: "off-palette", 2: "mixed colours", 3: "broken glyph"}

_REFERENCE = torch.tensor([(0, 0, 0)] + [PALETTE[c] for c in COLORS], dtype=torch.float32)  # (5, 3)
_TEMPLATES = torch.from_numpy(TEMPLATES)  # (3, CELL, CELL) bool


def _clean_cells() -> torch.Tensor:
    """(13, 3, CELL, CELL) float 0-255: the empty cell, then every item in ITEMS (code) order."""
    out = torch.zeros(1 + len(ITEMS), 3, CELL, CELL)
    for k, (color, shape) in enumerate(ITEMS, start=1):
        mask = _TEMPLATES[SHAPES.index(shape)]
        out[k] = mask[None].float() * torch.tensor(PALETTE[color], dtype=torch.float32)[:, None, None]
    return out


_CLEAN = _clean_cells()


@attrs.frozen
class Reading:
    """What the verifier read: per cell a code (INVALID, EMPTY or 1 + item index) and a reason."""

    codes: torch.Tensor  # (B, GRID, GRID) long, on the CPU
    reasons: torch.Tensor  # (B, GRID, GRID) long, on the CPU; REASONS keys, 0 = readable
    gold_error: torch.Tensor  # (B,) float32 mean absolute pixel error (0-255), on the CPU

    def scene(self, b: int) -> tuple[Placed, ...]:
        """The readable objects of image ``b``."""
        codes = self.codes[b].tolist()
        items = {(r, c): ITEMS[codes[r][c] - 1] for r in range(GRID) for c in range(GRID) if codes[r][c] > 0}
        return tuple(Placed(color, shape, r, c) for (r, c), (color, shape) in items.items())

    def describe(self, b: int) -> str:
        """What was read in image ``b``, e.g. ``2 blue circles, red square, 1 unreadable (broken
        glyph)``; ``nothing`` for an empty image. Shown under the image in sample grids."""
        counts = Counter((p.color, p.shape) for p in self.scene(b))
        parts = [f"{n} {c} {s}s" if n > 1 else f"{c} {s}" for (c, s), n in sorted(counts.items())]
        why = Counter(REASONS[r] for r in self.reasons[b].flatten().tolist() if r)
        parts += [f"{n} unreadable ({reason})" for reason, n in sorted(why.items())]
        return ", ".join(parts) or "nothing"

    @property
    def n_invalid(self) -> torch.Tensor:
        return (self.codes == INVALID).flatten(1).sum(1)

    @property
    def clean(self) -> torch.Tensor:
        return self.n_invalid == 0

    @property
    def clean_cells(self) -> torch.Tensor:
        """Fraction of readable cells per image."""
        return (self.codes != INVALID).flatten(1).float().mean(1)


def _to_255(images: torch.Tensor) -> torch.Tensor:
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(images)
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or tuple(images.shape[1:]) != (3, SIZE, SIZE):
        shape = tuple(images.shape) if hasattr(images, "shape") else type(images).__name__
        raise ValueError(f"shapes images must be a (B, 3, {SIZE}, {SIZE}) tensor, got {shape}")
    if images.dtype == torch.uint8:
        return images.float()
    return images.detach().float().clamp(0.0, 1.0) * 255.0


def read_cells(
    images: torch.Tensor, pixel_tolerance: float = PIXEL_TOLERANCE, glyph_tolerance: int = GLYPH_TOLERANCE
) -> Reading:
    """Parse (B, 3, 24, 24) images (float in [0, 1], or uint8 0-255) into cells; see the module
    docstring for the rules."""
    x = _to_255(images)
    batch, device = x.shape[0], x.device
    ref = _REFERENCE.to(device)
    dist = (x[:, None] - ref[None, :, :, None, None]).abs().amax(2)  # (B, 5, H, W)
    dmin, label = dist.min(1)  # (B, H, W)

    def cells(t: torch.Tensor) -> torch.Tensor:  # (B, H, W) -> (B, GRID, GRID, CELL, CELL)
        return t.reshape(batch, GRID, CELL, GRID, CELL).permute(0, 1, 3, 2, 4)

    off = cells(dmin > pixel_tolerance).flatten(3).any(-1)  # (B, G, G)
    label = cells(label)
    ink = label > 0
    n_ink = ink.flatten(3).sum(-1)
    per_colour = torch.stack([(label == k).flatten(3).sum(-1) for k in range(1, 1 + len(COLORS))], -1)
    mixed = (per_colour > 0).sum(-1) > 1
    colour = per_colour.argmax(-1)  # (B, G, G)
    templates = _TEMPLATES.to(device)
    hamming = (ink[:, :, :, None] != templates[None, None, None]).flatten(4).sum(-1)  # (B, G, G, 3)
    hmin, shape = hamming.min(-1)
    empty = n_ink == 0
    broken = ~empty & (hmin > glyph_tolerance)

    reasons = torch.zeros_like(colour)
    reasons = torch.where(~empty & broken, torch.full_like(reasons, 3), reasons)
    reasons = torch.where(~empty & mixed, torch.full_like(reasons, 2), reasons)
    reasons = torch.where(off, torch.full_like(reasons, 1), reasons)
    codes = 1 + colour * len(SHAPES) + shape
    codes = torch.where(empty, torch.full_like(codes, EMPTY), codes)
    codes = torch.where(reasons > 0, torch.full_like(codes, INVALID), codes)

    # gold: error against the clean re-render of what was read (INVALID: the nearest clean cell)
    xc = x.reshape(batch, 3, GRID, CELL, GRID, CELL).permute(0, 2, 4, 1, 3, 5)  # (B, G, G, 3, C, C)
    err = (xc[:, :, :, None] - _CLEAN.to(device)[None, None, None]).abs().flatten(4).mean(-1)  # (B,G,G,13)
    pick = torch.where(codes == INVALID, err.argmin(-1), codes)
    gold = err.gather(-1, pick[..., None])[..., 0].flatten(1).mean(1)
    return Reading(codes=codes.cpu(), reasons=reasons.cpu(), gold_error=gold.float().cpu())


def gold_error(
    images: torch.Tensor, pixel_tolerance: float = PIXEL_TOLERANCE, glyph_tolerance: int = GLYPH_TOLERANCE
) -> torch.Tensor:
    """(B,) mean absolute pixel error (0-255) between each image and a clean re-render of what the
    verifier read; 0 exactly for a clean render. RL does not optimise it: it exposes drift."""
    return read_cells(images, pixel_tolerance, glyph_tolerance).gold_error


def spec_for(prompt: str, metadata: Mapping[str, Any] | None = None) -> Spec:
    """The spec of a prompt: the prompt source's ``metadata["spec"]`` when given, else parsed."""
    if metadata and "spec" in metadata:
        spec = metadata["spec"]
        return spec if isinstance(spec, Spec) else Spec.from_dict(spec)
    return parse_prompt(prompt)


def evaluate(
    images: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]] | None = None,
    pixel_tolerance: float = PIXEL_TOLERANCE,
    glyph_tolerance: int = GLYPH_TOLERANCE,
) -> dict[str, Any]:
    """Everything the verifier knows about a batch, all (B,) CPU tensors or lists:
    accuracy (0/1), partial, clean (0/1), clean_cells, gold_error, category, category_id, and
    ``read``: what was read, one line per image."""
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
    metadata = list(metadata) if metadata is not None else [{}] * len(prompts)
    if len(metadata) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(metadata)} metadata entries")
    specs = [spec_for(p, m) for p, m in zip(prompts, metadata, strict=True)]
    reading = read_cells(images, pixel_tolerance, glyph_tolerance)
    n_invalid = reading.n_invalid.tolist()
    met_total = [match(reading.scene(b), spec, n_invalid[b]) for b, spec in enumerate(specs)]
    return {
        "accuracy": torch.tensor([float(m == t) for m, t in met_total]),
        "partial": torch.tensor([m / t for m, t in met_total], dtype=torch.float32),
        "clean": reading.clean.float(),
        "clean_cells": reading.clean_cells,
        "gold_error": reading.gold_error,
        "category": [s.category for s in specs],
        "category_id": torch.tensor([CATEGORIES.index(s.category) for s in specs], dtype=torch.long),
        "read": [reading.describe(b) for b in range(len(specs))],
    }


@attrs.define
class ShapesVerifier:
    """Rule-based compositional reward for the shapes world (GenEval-like; see module docstring).

    ``score: partial`` (default) rewards the fraction of constraints met, ``strict`` the 0/1
    accuracy; both are 1 only for a correct, clean image. ``fidelity_weight`` w subtracts
    w * gold_error / 255 (a fidelity term against sub-threshold drift; 0 = off).
    """

    category_noun = "GenEval category"

    score: Literal["strict", "partial"] = param(
        "partial", choices=("strict", "partial"), help="partial: fraction of constraints met; strict: 0/1 accuracy"
    )
    pixel_tolerance: float = param(
        PIXEL_TOLERANCE, ge=0.0, le=127.0, help="max L-inf distance (0-255) of a pixel to black or a palette colour"
    )
    glyph_tolerance: int = param(
        GLYPH_TOLERANCE, ge=0, le=5, help="max pixels by which a glyph's mask may differ from its template"
    )
    fidelity_weight: float = param(0.0, ge=0.0, help="subtract this times gold_error/255 from the score")

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        details = evaluate(outputs, prompts, metadata, self.pixel_tolerance, self.glyph_tolerance)
        scores = details["accuracy"] if self.score == "strict" else details["partial"]
        if self.fidelity_weight:
            scores = scores - self.fidelity_weight * details["gold_error"] / 255.0
        device = outputs.device if isinstance(outputs, torch.Tensor) else torch.device("cpu")
        return RewardResult(scores=scores.float().to(device), details=details)


@attrs.define
class ShapesGold:
    """The GOLD metric as a reward-like component: score = -gold_error (higher is better), so
    listing it by mistake among the rewards does not reward drift. Meant for evaluation only."""

    pixel_tolerance: float = param(PIXEL_TOLERANCE, ge=0.0, le=127.0, help="as for the shapes reward")
    glyph_tolerance: int = param(GLYPH_TOLERANCE, ge=0, le=5, help="as for the shapes reward")

    def __call__(
        self, outputs: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardResult:
        gold = gold_error(outputs, self.pixel_tolerance, self.glyph_tolerance)
        device = outputs.device if isinstance(outputs, torch.Tensor) else torch.device("cpu")
        return RewardResult(scores=(-gold).to(device), details={"gold_error": gold})


@attrs.define
class ShapesGoldEvaluator:
    """The shapes world's GOLD metric as an evaluator (``evaluator: shapes-gold``): the mean
    absolute pixel error between each evaluation sample and a clean re-render of what the
    verifier read (:func:`gold_error`), over the very samples the evaluation scored, overall and
    per GenEval category. With the same tolerances its ``gold/<label>/gold_error`` equals the
    ``eval/shapes/gold_error`` the ``shapes`` reward reports beside its score; lower is better.
    RL does not optimise it: it exposes drift the verifier's tolerances hide."""

    pixel_tolerance: float = param(PIXEL_TOLERANCE, ge=0.0, le=127.0, help="as for the shapes reward")
    glyph_tolerance: int = param(GLYPH_TOLERANCE, ge=0, le=5, help="as for the shapes reward")

    directions = {"gold_error": "lower"}
    category_noun = "GenEval category"
    limits = {"gold_error": 0.005}  # a change under 2.5 % of the base's 0.199 counts as none

    def __call__(self, context: Any) -> EvaluatorResult:
        gold = gold_error(context.samples, self.pixel_tolerance, self.glyph_tolerance).float()
        categories = [spec_for(p, context.metadata(p)).category for p in context.sample_prompts]
        # averaged as the evaluation averages the reward's details (per category, and their mean)
        return EvaluatorResult(metrics=detail_means({"gold_error": gold, "category": categories}))
