#!/usr/bin/env python
"""How long each CPU recipe takes, at each thread count, measured the way a user runs it.

    python tools/bench/recipe_times.py                      # every recipe with a '# time:' line
    python tools/bench/recipe_times.py shapes vector --threads 1 2 --iterations 6
    python tools/bench/recipe_times.py --write              # also rewrite each recipe's '# time:' line

Each (recipe, thread count) is one ``fgrpo compose`` in a fresh process with ``OMP_NUM_THREADS``
fixed (no governor), ``--iterations`` iterations and the recipe's own evaluation at the start and
the end. The figures: the mean seconds per iteration after the first ``--skip`` (the mean, not
the median: an iteration that does more now and then, as driving's closed-loop restarts every
20, is part of the recipe's time; measure such a recipe over more iterations than its period),
the median seconds per evaluation, and the set-up (the process's wall time less both). The
whole recipe's time is estimated from them: set-up + iterations x that mean + evaluations x
their median. Run it
on an idle machine, alone: two torch processes on 2 cores slow each other several-fold
(``tools/bench/contention.py`` measures by how much), and a figure taken beside other work says
nothing about the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _bench  # noqa: E402 - beside this script: python puts a script's own folder first on sys.path

RECIPES = _bench.ROOT / "recipes"
TIME_LINE = re.compile(r"^# time:.*$", re.MULTILINE)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "FGRPO_THREADS", "FGRPO_THREADS_CHOSEN", "MKL_NUM_THREADS")


def timed_recipes() -> list[str]:
    """The shipped recipes whose header has a ``# time:`` line (the ones that train on CPUs)."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml") if TIME_LINE.search(p.read_text()))


def plan_of(name: str) -> list[tuple[int, int]]:
    """(iterations, evaluations) of each stage of the recipe as shipped (one for most recipes)."""
    from fgrpo.core import recipe as recipe_mod

    plan = []
    for stage in recipe_mod.load(name).all_stages():
        every, total = stage.eval.every, stage.train.iterations
        evaluations = (total // every + (total % every != 0) + int(stage.eval.at_start)) if every else 0
        plan.append((total, evaluations))
    return plan


def measure(name: str, threads: int, iterations: int, skip: int) -> dict[str, Any]:
    """Per stage its mean seconds an iteration and median seconds an evaluation, and the set-up."""
    from fgrpo.core import composing, stages
    from fgrpo.core.shipped import find_recipe
    from fgrpo.core.yaml_reading import load_yaml

    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    written, _ = load_yaml(Path(find_recipe(name)).read_text(), name)
    shrunk = [f"train.iterations={iterations}", f"eval.every={iterations}", "train.checkpoint_every=0"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [str(Path(sys.executable).with_name("fgrpo")), "compose", name, "--out", str(out), "--quiet"]
        for item in stages.for_every_stage(written, [*shrunk, "log.plots=false"]):
            command += ["--set", item]
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise SystemExit(f"{name} at {threads} thread(s) failed:\n{done.stderr[-2000:]}")
        count = len(plan_of(name))
        logs = [composing.folder_of(out, k, count) / "metrics.jsonl" for k in range(1, count + 1)]
        rows_of = [[json.loads(line) for line in log.read_text().splitlines() if line.strip()] for log in logs]
    figures = []
    for rows in rows_of:
        per_iteration = [r["time_iteration_s"] for r in rows if "time_iteration_s" in r][skip:]
        evaluations = [r["time_eval_s"] for r in rows if "time_eval_s" in r]
        figures.append(
            {
                "iteration_s": statistics.fmean(per_iteration),
                "eval_s": statistics.median(evaluations) if evaluations else 0.0,
            }
        )
    spent = sum(r.get("time_iteration_s", 0.0) + r.get("time_eval_s", 0.0) for rows in rows_of for r in rows)
    return {"stages": figures, "setup_s": max(0.0, wall - spent)}


def whole(figures: dict[str, Any], plan: list[tuple[int, int]]) -> float:
    return figures["setup_s"] + sum(
        total * stage["iteration_s"] + evaluations * stage["eval_s"]
        for stage, (total, evaluations) in zip(figures["stages"], plan, strict=True)
    )


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def time_line(by_threads: dict[int, dict[str, Any]], plan: list[tuple[int, int]]) -> str:
    """``# time: 9 min on 2 idle threads (1.3 s an iteration, 30 s an evaluation); 14 min on 1 thread (...)``;
    a recipe in stages gives each figure per stage (``0.35 / 0.80 s an iteration``)."""
    parts = []
    for threads in sorted(by_threads, reverse=True):
        f = by_threads[threads]
        where = f"{threads} idle threads" if threads > 1 else "1 thread"
        paces = " / ".join(f"{stage['iteration_s']:.2f}" for stage in f["stages"])
        detail = f"{paces} s an iteration"
        if any(evaluations for _, evaluations in plan):
            evaluation = " / ".join(f"{stage['eval_s']:.0f}" for stage in f["stages"])
            detail += f", {evaluation} s an evaluation"
        stages = f" in {len(plan)} stages" if len(plan) > 1 else ""
        parts.append(f"{minutes(whole(f, plan))} on {where}{stages} ({detail})")
    return f"# time: {'; '.join(parts)} (tools/bench/recipe_times.py)"


def _header_end(text: str) -> int:
    at = 0
    for line in text.splitlines(keepends=True):
        if not line.startswith("#"):
            break
        at += len(line)
    return at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "recipes", nargs="*", help="shipped recipe names (default: every recipe with a '# time:' line)"
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--iterations", type=int, default=6, help="iterations per measured run")
    parser.add_argument("--skip", type=int, default=1, help="warm-up iterations left out of the median")
    parser.add_argument("--write", action="store_true", help="rewrite each recipe's '# time:' line")
    args = parser.parse_args(argv)
    if args.iterations <= args.skip:
        parser.error("--iterations must exceed --skip")
    print(f"{'recipe':18s} {'threads':>7s} {'s/iter':>8s} {'s/eval':>8s} {'setup s':>8s} {'whole':>8s}")
    for name in args.recipes or timed_recipes():
        plan = plan_of(name)
        by_threads = {t: measure(name, t, args.iterations, args.skip) for t in args.threads}
        for t, f in by_threads.items():
            for k, stage in enumerate(f["stages"], 1):
                label = name if len(plan) == 1 else f"{name}:{k}"
                setup = f"{f['setup_s']:8.1f} {minutes(whole(f, plan)):>8s}" if k == len(plan) else ""
                print(f"{label:18s} {t:7d} {stage['iteration_s']:8.2f} {stage['eval_s']:8.1f} {setup}", flush=True)
        if len(by_threads) > 1:
            few, many = min(by_threads), max(by_threads)
            ratio = whole(by_threads[few], plan) / whole(by_threads[many], plan)
            print(f"{'':18s} {few}-thread / {many}-thread: {ratio:.2f}x")
        line = time_line(by_threads, plan)
        print(line)
        if args.write:
            path = RECIPES / f"{name}.yaml"
            text = path.read_text()
            found = TIME_LINE.search(text)
            at, end = (found.start(), found.end()) if found else (_header_end(text),) * 2
            text = text[:at] + line + ("" if found else "\n") + text[end:]
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
