#!/usr/bin/env python
"""Where a recipe's iteration time goes: model, reward, decode and the rest (overhead).

    python tools/bench/iteration.py recipes/shapes.yaml --iterations 8
    python tools/bench/iteration.py recipes/shapes.yaml --iterations 6 \\
        --variant 'today' --variant 'once: train.reference=once'

Every run logs the same accounting (``time_model_s``: inside the policy's forward and backward;
``time_reward_s``; ``time_decode_s``; ``time_overhead_s``: the rest of ``time_iteration_s``);
this prints its median and [min, max] over the iterations, the share of model + reward, and
images per second. With several ``--variant 'NAME: key=value; key=value'`` the variants are
built side by side in one process and their iterations interleaved; the ratios of their
iteration times (median of per-round ratios against the first variant) are measured in this run.
Evaluation is off; the first ``--skip`` iterations of each variant are warm-up and not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _bench  # noqa: E402 - beside this script: python puts a script's own folder first on sys.path

COLUMNS = ("model", "reward", "decode", "overhead")


def report(rows: dict[str, list[dict]], images: dict[str, int]) -> list[str]:
    lines = []
    header = ["variant", "iteration s", *[f"{c} s" for c in COLUMNS], "model+reward", "images/s"]
    body = []
    for name, metrics in rows.items():
        it = [m["time_iteration_s"] for m in metrics]
        cells = [name, _bench.spread(it)]
        for c in COLUMNS:
            cells.append(_bench.spread([m[f"time_{c}_s"] for m in metrics]))
        share = [(m["time_model_s"] + m["time_reward_s"]) / m["time_iteration_s"] for m in metrics]
        cells.append(f"{_bench.median(share):.1%}")
        cells.append(f"{images[name] / _bench.median(it):.3g}")
        body.append(cells)
    lines.append(_bench.table(header, body))
    names = list(rows)
    if len(names) > 1:
        base = [m["time_iteration_s"] for m in rows[names[0]]]
        for name in names[1:]:
            ratio = _bench.paired_ratio([m["time_iteration_s"] for m in rows[name]], base)
            lines.append(f"time per iteration {name}/{names[0]}: {ratio:.3f} (images/s x{1 / ratio:.2f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--iterations", type=int, default=8, help="counted iterations per variant")
    parser.add_argument("--skip", type=int, default=1, help="warm-up iterations per variant, not counted")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="for every variant"
    )
    parser.add_argument("--variant", action="append", default=[], metavar="'NAME: K=V; K=V'")
    parser.add_argument("--json", type=Path, default=None, help="write every iteration's metrics here")
    args = parser.parse_args(argv)

    _bench.choose_threads()
    variants = [_bench.parse_variant(v) for v in args.variant] or [("recipe", [])]
    runs, images = {}, {}
    for name, overrides in variants:
        recipe = _bench.load_recipe(args.recipe, [*args.overrides, *overrides])
        runs[name] = _bench.build(recipe)
        images[name] = recipe.train.prompts_per_iteration * recipe.train.group_size
    rows = _bench.interleave(runs, args.iterations, args.skip)
    print(
        f"{args.recipe}: {args.iterations} iterations per variant after {args.skip} warm-up, interleaved; "
        f"{_bench.machine_line()}"
    )
    for line in report(rows, images):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, default=float, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
