#!/usr/bin/env python
"""The objectives side by side on the shapes world: held-out strict accuracy and gold error at equal
time and at equal NFE, and how soon each reaches the main job's final accuracy.

    python tools/bench/objectives.py                       # every recipe below, one after another
    python tools/bench/objectives.py --only nft,awm --json nft-awm.json
    python tools/bench/objectives.py --table grpo.json nft-awm.json     # one table from saved runs

The main job (``grpo``: recipes/shapes.yaml, its 200 iterations) runs first and sets the budget:
its training time T and final accuracy A. Every other recipe trains for T (or until its own
iterations end) from the same base and seed. "Time" is the process's CPU seconds spent in training
iterations (``time.process_time``; evaluations excluded), with ``--threads`` torch threads (default
1), so a busy machine slows a run's wall clock but not its count; ``--clock wall`` counts wall
seconds instead (a quiet machine). Every ``--every`` seconds of that clock, and at the end, the
policy is evaluated on the held-out prompts (the recipe's ``eval`` settings: its steps, samples per
prompt, EMA weights) and the samples are read by the shapes verifier: strict accuracy and gold error
(pixel error against a clean re-render of what the verifier read), whatever reward the recipe trains
on. The equal-NFE table reads those evaluations at multiples of the main job's NFE / 10 (rollout +
update network evaluations), interpolated linearly between evaluations. The last lines give, for
each recipe, the first evaluation at or above A, its time as a fraction of T, and its gold error as
a multiple of the base's (the target: nft or awm at <= 1/3 of T with <= 1.2x the base's gold).

On a busy machine the main job can be cut short: ``--main-budget S`` stops it after S seconds, and
T is then its measured time per iteration times its iterations (marked "extrapolated"); the
accuracy to reach is then ``--target-accuracy`` (a full main job's final accuracy, measured
elsewhere: say where) or, without it, the cut main job's last. Every line says which.

Recipes (``--variant 'NAME: RECIPE; key=value; ...'`` adds or replaces one): grpo (shapes.yaml),
grpo-guard, fast, mixgrpo-flash (shapes-mixgrpo.yaml), nft, awm, dpo, pairwise (shapes-pairwise.yaml:
Pref-GRPO's win rates over the verifier's partial score).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import _bench  # noqa: E402 - beside this script: python puts a script's own folder first on sys.path

RECIPES = {
    "grpo": "recipes/shapes.yaml",
    "grpo-guard": "recipes/shapes-guard.yaml",
    "fast": "recipes/shapes-fast.yaml",
    "mixgrpo-flash": "recipes/shapes-mixgrpo.yaml",
    "nft": "recipes/shapes-nft.yaml",
    "awm": "recipes/shapes-awm.yaml",
    "dpo": "recipes/shapes-dpo.yaml",
    "pairwise": "recipes/shapes-pairwise.yaml",
}
MAIN = "grpo"
LAST_EVALUATION = "the main job's last evaluation"


class Clock:
    """Seconds of training: the process's CPU time (default) or the wall clock."""

    def __init__(self, kind: str):
        self.read = time.process_time if kind == "cpu" else time.perf_counter
        self.spent = 0.0

    def measure(self, fn, *args):
        start = self.read()
        out = fn(*args)
        self.spent += self.read() - start
        return out


def held_out(run, iteration: int) -> dict[str, float]:
    """Strict accuracy and gold error of the held-out samples, read by the shapes verifier."""
    import torch

    from fgrpo.core import evaluation
    from fgrpo.core.registry import create

    outputs, _prompts = evaluation.evaluation_samples(run, iteration)
    prompts = list(_prompts)
    verifier = create("reward", "shapes", score="strict")
    details = verifier(outputs, prompts, [run.prompts.metadata(p) for p in prompts]).details
    return {
        "accuracy": float(torch.as_tensor(details["accuracy"]).float().mean()),
        "gold_error": float(torch.as_tensor(details["gold_error"]).float().mean()),
    }


def train(name: str, path: str, overrides: list[str], budget: float | None, every: float, clock_kind: str) -> dict:
    """Train one recipe for ``budget`` seconds of its clock (None: all its iterations), evaluating
    every ``every`` seconds, at the start and at the end."""
    import attrs
    from rich.console import Console

    from fgrpo.core import recipe as recipe_mod
    from fgrpo.core.building import build_run
    from fgrpo.core.trainer import iteration

    recipe = recipe_mod.load(str(_bench.ROOT / path), overrides)
    recipe = attrs.evolve(recipe, eval=attrs.evolve(recipe.eval, every=0))
    run = build_run(recipe, out_dir=None, console=Console(quiet=True), quiet=True)
    clock = Clock(clock_kind)
    nfe, points = 0, []
    mark = every

    def evaluate(it: int) -> None:
        points.append({"iteration": it, "seconds": round(clock.spent, 2), "nfe": nfe, **held_out(run, it)})
        print(
            f"  {name} it {it:4d}  {clock.spent:7.1f} s  NFE {nfe:8d}  accuracy {points[-1]['accuracy']:.3f}  gold "
            f"{points[-1]['gold_error']:.4f}",
            flush=True,
        )

    evaluate(0)
    for it in range(recipe.train.iterations):
        metrics = clock.measure(iteration, run, it)
        nfe += int(metrics["nfe_rollout"]) + int(metrics["nfe_train"])
        done = it + 1
        out_of_time = budget is not None and clock.spent >= budget
        if clock.spent >= mark or out_of_time or done == recipe.train.iterations:
            evaluate(done)
            while mark <= clock.spent:
                mark += every
        if out_of_time:
            break
    return {
        "name": name,
        "recipe": path,
        "overrides": overrides,
        "clock": clock_kind,
        "iterations": recipe.train.iterations,
        "points": points,
        "machine": _bench.machine_line(),  # its threads and load, for a table printed later from the file
    }


def at(points: list[dict], key: str, axis: str, x: float) -> float | None:
    """``key`` at ``axis`` = x, linear between evaluations (None past the last one)."""
    for a, b in itertools.pairwise(points):
        if a[axis] <= x <= b[axis]:
            w = 0.0 if b[axis] == a[axis] else (x - a[axis]) / (b[axis] - a[axis])
            return a[key] + w * (b[key] - a[key])
    return None


def evaluation_at_mark(points: list[dict], mark: float) -> tuple[dict, bool]:
    """The evaluation a run made on crossing ``mark`` seconds (the first at or after it: it lands
    less than one iteration later), or, when the run ended before the mark, its last one (True)."""
    after = [p for p in points if p["seconds"] >= mark - 1e-9]
    return (after[0], False) if after else (points[-1], True)


def main_job_time(main: dict) -> tuple[float, str]:
    """The main job's training time T: measured, or extrapolated from a cut run to its iterations."""
    last = main["points"][-1]
    planned = main.get("iterations") or last["iteration"]
    if last["iteration"] >= planned or last["iteration"] == 0:
        return last["seconds"], "measured"
    return last["seconds"] / last[
        "iteration"
    ] * planned, f"extrapolated from {last['iteration']} of its {planned} iterations"


def report(runs: list[dict], every: float, target_accuracy: float | None = None) -> list[str]:
    main = next((r for r in runs if r["name"] == MAIN), None)
    measured_on = sorted({r["machine"] for r in runs if "machine" in r})
    lines = [f"measured with {m}" for m in measured_on] if measured_on else [_bench.machine_line()]
    if main is None:
        lines.append(f"no {MAIN} run: the budget and target come from the main job")
        return lines
    target_time, how = main_job_time(main)
    measured_end = max(r["points"][-1]["seconds"] for r in runs)
    target = main["points"][-1]["accuracy"] if target_accuracy is None else target_accuracy
    base_gold = main["points"][0]["gold_error"]
    total_nfe = main["points"][-1]["nfe"]
    clock = main["clock"]
    lines.append(
        f"main job: {main['recipe']}, {main['points'][-1]['iteration']} iterations, "
        f"{main['points'][-1]['seconds']:.0f} {clock} s, "
        f"accuracy {main['points'][0]['accuracy']:.3f} -> {main['points'][-1]['accuracy']:.3f}, gold {base_gold:.4f} "
        f"-> {main['points'][-1]['gold_error']:.4f}"
    )
    lines.append(
        f"T = {target_time:.0f} {clock} s ({how}); accuracy to reach {target:.3f} "
        f"({'given: --target-accuracy' if target_accuracy is not None else LAST_EVALUATION})"
    )
    marks = [every * k for k in range(1, int(min(target_time, measured_end) // every) + 1)]
    header = ["recipe"] + [f"{m:.0f} s" for m in marks]
    body = []
    for r in runs:
        cells = [r["name"]]
        for m in marks:
            p, ended = evaluation_at_mark(r["points"], m)
            cells.append(f"{p['accuracy']:.3f} / {p['gold_error']:.4f}{' *' if ended else ''}")
        body.append(cells)
    lines += [
        "",
        f"held-out strict accuracy / gold error at equal {clock} time (the evaluation made on crossing each mark, "
        f"less than one iteration after it; * = the run had ended before the mark: its last evaluation)",
        _bench.table(header, body),
    ]
    nfe_marks = [total_nfe * k / 10 for k in range(1, 11)]
    header = ["recipe"] + [f"{m / 1e3:.0f}k" for m in nfe_marks]
    body = []
    for r in runs:
        cells = [r["name"]]
        for m in nfe_marks:
            a, g = at(r["points"], "accuracy", "nfe", m), at(r["points"], "gold_error", "nfe", m)
            cells.append("-" if a is None else f"{a:.3f} / {g:.4f}")
        body.append(cells)
    lines += [
        "",
        "held-out strict accuracy / gold error at equal NFE (interpolated between evaluations)",
        _bench.table(header, body),
    ]
    lines += [
        "",
        f"first evaluation at or above {target:.3f} (T = {target_time:.0f} {clock} s, base gold {base_gold:.4f})",
    ]
    for r in runs:
        hit = next((p for p in r["points"][1:] if p["accuracy"] >= target), None)
        best = max(r["points"][1:] or r["points"], key=lambda p: p["accuracy"])
        if hit is None:
            lines.append(
                f"  {r['name']:14s} not reached; best {best['accuracy']:.3f} at {best['seconds']:.0f} s (gold "
                f"{best['gold_error'] / base_gold:.2f}x base)"
            )
        else:
            lines.append(
                f"  {r['name']:14s} {hit['seconds']:.0f} s = {hit['seconds'] / target_time:.2f} T, iteration "
                f"{hit['iteration']}, "
                f"gold {hit['gold_error']:.4f} = {hit['gold_error'] / base_gold:.2f}x base"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated recipe names (default: all)")
    parser.add_argument("--variant", action="append", default=[], metavar="'NAME: RECIPE; K=V; ...'")
    parser.add_argument("--every", type=float, default=60.0, help="seconds of training between evaluations")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds of training per recipe (default: the main job's)"
    )
    parser.add_argument(
        "--main-budget",
        type=float,
        default=None,
        help="stop the main job after this many seconds (T is then extrapolated)",
    )
    parser.add_argument(
        "--target-accuracy", type=float, default=None, help="the accuracy to reach (default: the main job's last)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="write the runs here")
    parser.add_argument(
        "--table", type=Path, nargs="*", default=None, help="print the table of saved runs (no training)"
    )
    args = parser.parse_args(argv)

    if args.table is not None:
        runs = [r for path in args.table for r in json.loads(path.read_text())]
        print("\n".join(report(runs, args.every, args.target_accuracy)))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    recipes = {name: (path, []) for name, path in RECIPES.items()}
    for text in args.variant:
        name, parts = _bench.parse_variant(text)
        recipes[name] = (parts[0], parts[1:])
    names = [n for n in args.only.split(",") if n] or list(recipes)
    runs, budget = [], args.budget
    for name in sorted(names, key=lambda n: n != MAIN):  # the main job first: it sets the budget
        path, overrides = recipes[name]
        print(f"{name}: {path} {' '.join(overrides)}", flush=True)
        runs.append(train(name, path, overrides, args.main_budget if name == MAIN else budget, args.every, args.clock))
        if name == MAIN and budget is None:
            budget = runs[-1]["points"][-1]["seconds"]
        if args.json is not None:
            args.json.write_text(json.dumps(runs, indent=1))
    print("\n".join(report(runs, args.every, args.target_accuracy)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
