"""What the benchmarks under tools/bench/ share: runs built side by side from recipe variants,
their iterations interleaved, and figures printed as medians, spreads and ratios of one run.

Interleaving (A B C A B C ...) puts the variants under the same machine load at the same moments,
so their ratios hold on a busy machine where absolute seconds do not.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def choose_threads() -> None:
    """The thread choice ``fgrpo`` makes (before torch loads), so a benchmark measures what a
    user's run gets."""
    from fgrpo.core import threads

    threads.configure()


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``'name: key=value; key=value'`` -> (name, ["key=value", ...]); ``'name'`` alone: no change."""
    name, _, rest = text.partition(":")
    overrides = [part.strip() for part in rest.split(";") if part.strip()]
    return name.strip(), overrides


def load_recipe(path: str, overrides: Sequence[str]) -> Any:
    from fgrpo.core import recipe as recipe_mod

    return recipe_mod.load(path, list(overrides))


def build(recipe: Any) -> Any:
    """A run of ``recipe`` without a folder, evaluation or progress bars."""
    import attrs
    from rich.console import Console

    from fgrpo.core.building import build_run

    recipe = attrs.evolve(recipe, eval=attrs.evolve(recipe.eval, every=0))
    return build_run(recipe, out_dir=None, console=Console(quiet=True), quiet=True)


def interleave(runs: dict[str, Any], iterations: int, skip: int, step: Any = None) -> dict[str, list[dict[str, Any]]]:
    """``iterations`` iterations of every run, round-robin; the first ``skip`` of each dropped
    (warm-up). ``step(run, it)`` makes one iteration's metrics (default: ``trainer.iteration``)."""
    from fgrpo.core import trainer

    step = step or trainer.iteration
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    names = list(runs)
    for it in range(iterations + skip):
        order = names if it % 2 == 0 else names[::-1]  # alternate who goes first
        for name in order:
            metrics = step(runs[name], it)
            if it >= skip:
                rows[name].append(metrics)
    return rows


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    """``median [min, max]`` with three significant digits."""
    if not values:
        return "n/a"
    return f"{median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-round ratios a_i / b_i (each pair measured moments apart)."""
    return median([x / y for x, y in zip(a, b, strict=True) if y > 0])


def machine_line() -> str:
    import torch

    try:
        load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "n/a"
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {load}, python "
        f"{sys.version.split()[0]}"
    )


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in cells)
