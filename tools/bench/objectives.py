#!/usr/bin/env python
"""The objectives side by side on a world, over seeds: the held-out metric and the gold at equal time
and at equal NFE, how soon each reaches the main job's final metric, and which is best at the gold
limit (the leaderboard).

    python tools/bench/objectives.py                       # shapes: every recipe, one after another
    python tools/bench/objectives.py --only nft,awm --json nft-awm.json
    python tools/bench/objectives.py --table grpo.json nft-awm.json     # one table from saved runs
    python tools/bench/objectives.py --seeds 0,1,2 --budget 300 --jobs 2 --json shapes.json   # the leaderboard
    python tools/bench/objectives.py --world shapes-edit --seeds 0,1,2 --budget 300 --jobs 2 --json edit.json
    python tools/bench/objectives.py --world driving --seeds 0,1,2 --budget 300 --jobs 2 --json driving.json

Worlds (``--world``, tools/bench/_leaderboard.py): ``shapes`` (held-out strict accuracy read by the
shapes verifier, gold error; thirteen recipes: grpo, grpo-guard, fast, mixgrpo-flash, nft, awm, dpo,
pairwise, dgpo, flow-dppo, tempflow, flash, branch), ``shapes-edit`` (held-out edit accuracy, the
preservation gold error; the editing recipe (nft), the previous one (awm), and nft-shapes, grpo,
flow-dppo, dgpo on the previous recipe's reward) and
``driving`` (CL-score and collisions of the closed loop; the planner recipe (nft) and grpo, awm,
flow-dppo, dgpo on it). The gold limit is 1.2x the base's gold on every seed (driving: collisions
at most the base's).

The main job (shapes: ``grpo``, recipes/shapes.yaml, its 200 iterations) runs first for each seed and
sets that seed's budget unless ``--budget`` fixes one: its training time T and final metric A. Every
other recipe trains for the budget (or until its own iterations end) from the same base and seed
(``--seeds`` sets the recipe's ``seed``, which also draws the evaluation's noise). "Time" is the
process's CPU seconds spent in training iterations (``time.process_time``; evaluations excluded),
with ``--threads`` torch threads (default 1), so a busy machine slows a run's wall clock but not its
count; ``--clock wall`` counts wall seconds instead (a quiet machine). ``--jobs N`` runs N recipes at
once, each in its own process (two at a time on 2 cores, one thread each). Every ``--every`` seconds
of that clock, and at the end, the policy is evaluated on the held-out prompts (the recipe's
``eval`` settings: its steps, samples per prompt, EMA weights). The equal-NFE table reads those
evaluations at multiples of the main job's NFE / 10 (rollout + update network evaluations),
interpolated linearly between evaluations. Over several seeds each cell is mean ± sd. The last
lines give, for each recipe and seed, the first evaluation at or above A, its time as a fraction of
T and its gold as a multiple of the base's, and the leaderboard at the end of the budgets.

On a busy machine the main job can be cut short: ``--main-budget S`` stops it after S seconds, and
T is then its measured time per iteration times its iterations (marked "extrapolated"); the
metric to reach is then ``--target-accuracy`` (a full main job's final metric, measured
elsewhere: say where) or, without it, the cut main job's last. Every line says which.

``--variant 'NAME: RECIPE; key=value; ...'`` adds or replaces one recipe of the world.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _bench  # noqa: E402 - beside this script: python puts a script's own folder first on sys.path
import _leaderboard
from _leaderboard import BOARDS, Board, mean_spread, normalised

LAST_EVALUATION = "the main job's last evaluation"
MAX_COLUMNS = 12  #: equal-time columns in a table (more marks are thinned evenly)


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


def train(
    name: str,
    path: str,
    overrides: list[str],
    budget: float | None,
    every: float,
    clock_kind: str,
    board: Board = BOARDS["shapes"],
    seed: int | None = None,
) -> dict:
    """Train one recipe for ``budget`` seconds of its clock (None: all its iterations), evaluating
    every ``every`` seconds, at the start and at the end."""
    import attrs
    from rich.console import Console

    from fgrpo.core import recipe as recipe_mod
    from fgrpo.core.building import build_run
    from fgrpo.core.trainer import iteration

    seeded = [*overrides, f"seed={seed}"] if seed is not None else list(overrides)
    recipe = recipe_mod.load(str(_bench.ROOT / path), seeded)
    recipe = attrs.evolve(recipe, eval=attrs.evolve(recipe.eval, every=0))
    run = build_run(recipe, out_dir=None, console=Console(quiet=True), quiet=True)
    clock = Clock(clock_kind)
    nfe, points = 0, []
    mark = every

    def evaluate(it: int) -> None:
        points.append({"iteration": it, "seconds": round(clock.spent, 2), "nfe": nfe, **board.read(run, it)})
        print(
            f"  {name} seed {recipe.seed} it {it:4d}  {clock.spent:7.1f} s  NFE {nfe:8d}  {board.metric} "
            f"{points[-1]['metric']:.3f}  {board.gold} {points[-1]['gold']:.4f}",
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
        "world": board.world,
        "seed": recipe.seed,
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


def cell(metric: Sequence[float], gold: Sequence[float], ended: bool = False) -> str:
    """``metric / gold`` (mean ± sd over seeds), `` *`` where a run had ended before the mark."""
    return f"{mean_spread(metric)} / {mean_spread(gold, 4)}{' *' if ended else ''}"


def by_name(runs: Sequence[dict]) -> dict[str, list[dict]]:
    """The runs grouped by recipe name, in order of first appearance, each with normalised points."""
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(r["name"], []).append({**r, "points": [normalised(p) for p in r["points"]]})
    return out


def report(
    runs: list[dict], every: float, target_accuracy: float | None = None, board: Board | None = None
) -> list[str]:
    if board is None:
        board = BOARDS[runs[0].get("world", "shapes")] if runs else BOARDS["shapes"]
    groups = by_name(runs)
    measured_on = sorted({r["machine"] for r in runs if "machine" in r})
    lines = [f"measured with {m}" for m in measured_on] if measured_on else [_bench.machine_line()]
    mains = {int(r.get("seed", 0)): r for r in groups.get(board.main, [])}
    if not mains:
        lines.append(f"no {board.main} run: the budget and target come from the main job")
        return lines
    clock = next(iter(mains.values()))["clock"]
    times = {s: main_job_time(m) for s, m in mains.items()}
    targets = {
        s: (m["points"][-1]["metric"] if target_accuracy is None else target_accuracy) for s, m in mains.items()
    }
    base_gold = {s: m["points"][0]["gold"] for s, m in mains.items()}
    for s, m in sorted(mains.items()):
        first, last = m["points"][0], m["points"][-1]
        seed_words = f" seed {s}," if len(mains) > 1 else ""
        lines.append(
            f"main job:{seed_words} {m['recipe']}, {last['iteration']} iterations, {last['seconds']:.0f} {clock} s, "
            f"{board.metric} {first['metric']:.3f} -> {last['metric']:.3f}, {board.gold} {first['gold']:.4f} "
            f"-> {last['gold']:.4f}"
        )
        lines.append(
            f"T = {times[s][0]:.0f} {clock} s ({times[s][1]}); {board.metric} to reach {targets[s]:.3f} "
            f"({'given: --target-accuracy' if target_accuracy is not None else LAST_EVALUATION})"
        )
    target_time = statistics.fmean(t for t, _ in times.values())
    measured_end = max(r["points"][-1]["seconds"] for r in runs)
    marks = [every * k for k in range(1, int(min(target_time, measured_end) // every) + 1)]
    marks = marks[:: -(-len(marks) // MAX_COLUMNS)] if marks else marks  # at most MAX_COLUMNS, evenly thinned
    body = []
    for name, group in groups.items():
        cells = [name]
        for m in marks:
            found = [evaluation_at_mark(r["points"], m) for r in group]
            cells.append(
                cell([p["metric"] for p, _ in found], [p["gold"] for p, _ in found], any(e for _, e in found))
            )
        body.append(cells)
    lines += [
        "",
        f"{board.metric} / {board.gold} at equal {clock} time (the evaluation made on crossing each mark, less than "
        f"one iteration after it; * = a run had ended before the mark: its last evaluation)",
        _bench.table(["recipe"] + [f"{m:.0f} s" for m in marks], body),
    ]
    total_nfe = statistics.fmean(m["points"][-1]["nfe"] for m in mains.values())
    nfe_marks = [total_nfe * k / 10 for k in range(1, 11)]
    body = []
    for name, group in groups.items():
        cells = [name]
        for m in nfe_marks:
            metric = [at(r["points"], "metric", "nfe", m) for r in group]
            gold = [at(r["points"], "gold", "nfe", m) for r in group]
            known = [(a, g) for a, g in zip(metric, gold, strict=True) if a is not None and g is not None]
            cells.append("-" if len(known) < len(group) else cell([a for a, _ in known], [g for _, g in known]))
        body.append(cells)
    lines += [
        "",
        f"{board.metric} / {board.gold} at equal NFE (interpolated between evaluations)",
        _bench.table(["recipe"] + [f"{m / 1e3:.0f}k" if m >= 1e4 else f"{m:.0f}" for m in nfe_marks], body),
    ]
    lines += ["", *reaching_lines(groups, times, targets, base_gold, board, clock)]
    if len(mains) > 1 or any(len(g) > 1 for g in groups.values()):
        lines += ["", *_leaderboard.leaderboard(board, runs)]
    return lines


def reaching_lines(
    groups: dict[str, list[dict]],
    times: dict[int, tuple[float, str]],
    targets: dict[int, float],
    base_gold: dict[int, float],
    board: Board,
    clock: str,
) -> list[str]:
    """Per recipe and seed: the first evaluation at or above the seed's target, its time as a
    fraction of that seed's T and its gold as a multiple of the base's; or the best it reached."""
    seeds = sorted(targets)
    if len(seeds) == 1:
        s = seeds[0]
        lines = [
            f"first evaluation at or above {targets[s]:.3f} (T = {times[s][0]:.0f} {clock} s, base gold "
            f"{base_gold[s]:.4f})"
        ]
    else:
        lines = [f"first evaluation at or above each seed's target (seeds {', '.join(map(str, seeds))})"]
    for name, group in groups.items():
        parts = []
        for r in group:
            s = int(r.get("seed", 0))
            if s not in targets:
                continue
            hit = next((p for p in r["points"][1:] if p["metric"] >= targets[s]), None)
            best = max(r["points"][1:] or r["points"], key=lambda p: p["metric"])
            prefix = f"seed {s}: " if len(seeds) > 1 else ""
            if hit is None:
                parts.append(
                    f"{prefix}not reached; best {best['metric']:.3f} at {best['seconds']:.0f} s (gold "
                    f"{best['gold'] / base_gold[s]:.2f}x base)"
                )
            else:
                parts.append(
                    f"{prefix}{hit['seconds']:.0f} s = {hit['seconds'] / times[s][0]:.2f} T, iteration "
                    f"{hit['iteration']}, gold {hit['gold']:.4f} = {hit['gold'] / base_gold[s]:.2f}x base"
                )
        lines.append(f"  {name:14s} " + "; ".join(parts))
    return lines


def worker_command(
    args: argparse.Namespace,
    name: str,
    recipe: tuple[str, list[str]],
    seed: int | None,
    budget: float | None,
    out: Path,
) -> list[str]:
    """This script, in a fresh process, for one recipe and seed (``--jobs``)."""
    path, overrides = recipe
    command = [sys.executable, str(Path(__file__).resolve()), "--world", args.world, "--only", name]
    command += ["--variant", f"{name}: {'; '.join([path, *overrides])}", "--every", str(args.every)]
    command += ["--threads", str(args.threads), "--clock", args.clock, "--json", str(out), "--jobs", "1", "--no-table"]
    if seed is not None:
        command += ["--seeds", str(seed)]
    if budget is not None:
        command += ["--budget", str(budget)]
    if name == args.main and args.main_budget is not None:
        command += ["--main-budget", str(args.main_budget)]
    return command


def run_in_parallel(commands: list[tuple[list[str], Path]], jobs: int) -> list[dict]:
    """Run the worker commands ``jobs`` at a time; their saved runs, in the order given."""
    pending, running, results = list(commands), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            command, out = pending.pop(0)
            running.append((subprocess.Popen(command), out))
        for proc, out in list(running):
            if proc.poll() is not None:
                running.remove((proc, out))
                if proc.returncode != 0:
                    raise SystemExit(f"a worker failed ({proc.returncode}): {' '.join(proc.args)}")
                results[out] = json.loads(out.read_text())
        time.sleep(0.5)
    return [r for _, out in commands for r in results[out]]


def plan(args: argparse.Namespace, board: Board) -> tuple[dict[str, tuple[str, list[str]]], list[str], list[Any]]:
    recipes: dict[str, tuple[str, list[str]]] = dict(board.recipes)
    for text in args.variant:
        name, parts = _bench.parse_variant(text)
        recipes[name] = (parts[0], parts[1:])
    names = [n for n in args.only.split(",") if n] or list(recipes)
    unknown = [n for n in names if n not in recipes]
    if unknown:
        raise SystemExit(
            f"--only: unknown recipe(s) {', '.join(unknown)}; the {board.world} world has {', '.join(recipes)}"
        )
    seeds: list[Any] = [int(s) for s in args.seeds.split(",") if s.strip()] or [None]
    return recipes, sorted(names, key=lambda n: n != board.main), seeds  # the main job first: it sets the budget


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", choices=sorted(BOARDS), default="shapes")
    parser.add_argument("--only", default="", help="comma-separated recipe names (default: all of the world's)")
    parser.add_argument("--variant", action="append", default=[], metavar="'NAME: RECIPE; K=V; ...'")
    parser.add_argument("--seeds", default="", help="comma-separated seeds (default: each recipe's own)")
    parser.add_argument("--jobs", type=int, default=1, help="recipes trained at once, each in its own process")
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
        "--target-accuracy", type=float, default=None, help="the metric to reach (default: the main job's last)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--json", type=Path, default=None, help="write the runs here")
    parser.add_argument(
        "--table", type=Path, nargs="*", default=None, help="print the table of saved runs (no training)"
    )
    parser.add_argument("--no-table", action="store_true", help="train and save the runs, print no tables")
    args = parser.parse_args(argv)
    board = BOARDS[args.world]
    args.main = board.main

    if args.table is not None:
        runs = [r for path in args.table for r in json.loads(path.read_text())]
        print(
            "\n".join(report(runs, args.every, args.target_accuracy, board=BOARDS[runs[0].get("world", args.world)]))
        )
        return 0
    recipes, names, seeds = plan(args, board)
    if args.jobs > 1:
        runs = train_in_processes(args, recipes, names, seeds)
    else:
        runs = train_here(args, board, recipes, names, seeds)
    if not args.no_table:
        print("\n".join(report(runs, args.every, args.target_accuracy, board=board)))
    return 0


def train_here(
    args: argparse.Namespace, board: Board, recipes: dict, names: list[str], seeds: list[Any]
) -> list[dict]:
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    runs: list[dict] = []
    for seed in seeds:
        budget = args.budget
        for name in names:
            path, overrides = recipes[name]
            print(f"{name}: {path} {' '.join(overrides)}{'' if seed is None else f' seed={seed}'}", flush=True)
            cut = args.main_budget if name == board.main else budget
            runs.append(train(name, path, overrides, cut, args.every, args.clock, board, seed))
            if name == board.main and budget is None:
                budget = runs[-1]["points"][-1]["seconds"]
            if args.json is not None:
                args.json.write_text(json.dumps(runs, indent=1))
    return runs


def train_in_processes(args: argparse.Namespace, recipes: dict, names: list[str], seeds: list[Any]) -> list[dict]:
    """The main jobs first (all seeds, ``--jobs`` at a time) when they set the budget, then the rest."""
    with tempfile.TemporaryDirectory(prefix="fgrpo-objectives-") as tmp:
        folder = Path(tmp)

        def commands(chosen: list[str], budgets: dict[Any, float | None]) -> list[tuple[list[str], Path]]:
            out = []
            for name in chosen:
                for seed in seeds:
                    file = folder / f"{name}-{seed}.json"
                    out.append((worker_command(args, name, recipes[name], seed, budgets[seed], file), file))
            return out

        budgets: dict[Any, float | None] = {seed: args.budget for seed in seeds}
        runs: list[dict] = []
        rest = list(names)
        if args.budget is None and args.main in names:
            runs += run_in_parallel(commands([args.main], budgets), args.jobs)  # one run per seed, in order
            budgets = {seed: r["points"][-1]["seconds"] for seed, r in zip(seeds, runs, strict=True)}
            rest.remove(args.main)
        runs += run_in_parallel(commands(rest, budgets), args.jobs)
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))
    return runs


if __name__ == "__main__":
    raise SystemExit(main())
