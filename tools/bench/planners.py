"""The planners against our gold and highway-env in one run: the BC base, Flow-GRPO on the rollout,
``recipes/driving-nft.yaml`` (NFT in our world alone), ``recipes/driving-highway.yaml`` (NFT with a
randomised world and highway-env's states) and ``recipes/driving.yaml`` (the same followed by
Flow-GRPO's clipped update from its weights, the recipe's second stage), each trained on the
recipe's seeds, judged on the 1000 held-out scenarios of our world and in highway-env under the
standard configuration and two that no recipe trains on, alone and behind the safety filter, with
shadow mode in both worlds. Out of CI: each highway-env configuration costs about 10 min of one
thread per planner at 300 episodes.

    python tools/bench/planners.py --work /tmp/planners --seeds 0,1,2 --episodes 300 --jobs 2

Every cell (a training run, an evaluation) is a process of its own whose result is saved under
``--work``: a stopped bench resumes where it stopped, and ``--table`` prints what is there. A
``--set`` reaches every stage of a recipe in stages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _bench
import _leaderboard

RECIPES = _bench.ROOT / "recipes"
#: each planner: (its recipe, the overrides that make it), or None for the BC base (nothing trained)
PLANNERS: dict[str, tuple[str, list[str]] | None] = {
    "bc": None,
    "flow-grpo": ("driving-nft.yaml", _leaderboard.DRIVING["grpo"][1]),
    "driving-nft.yaml": ("driving-nft.yaml", []),  # NFT in our world alone
    # NFT with the transfer levers: a randomised world and highway-env's states
    "driving-highway.yaml": ("driving-highway.yaml", []),
    # then Flow-GRPO's clipped update from its weights, in the same worlds: the recipe in two stages
    "driving.yaml": ("driving.yaml", []),
}


#: an evaluation judges held-out scenarios only: the training starts (highway-env's episodes, the
#: randomised scenes) are not built for it, which would cost every evaluation cell their set-up
TRAINING_STARTS_OFF = ["prompts.randomize=null", "prompts.highway=null"]


def recipe_of(planner: str) -> tuple[str, list[str]]:
    """The planner's recipe file and overrides (the base: the recipe that trains NFT in our world alone)."""
    name, overrides = PLANNERS[planner] or ("driving-nft.yaml", [])
    return str(RECIPES / name), list(overrides)


#: highway-env configurations judged: the standard one (driving-highway's defaults) and two that
#: no recipe trains on (prompts.highway's configurations are others; docs/planners.md)
HIGHWAY = {
    "standard": {},
    "3-lane-dense": {"lanes": 3, "vehicles": 30, "density": 1.5},
    "aggressive": {"lanes": 4, "vehicles": 30, "behaviour": "aggressive"},
}
FIRST_EPISODE = 10_000
FILTER = "{}"  # the safety filter's defaults
METRICS = ("cl_score", "collision")


def flow(mapping: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"


def evaluators(episodes: int, shadow_episodes: int) -> dict[str, str]:
    """Every evaluation of a planner by name: its ``evaluator=`` value."""
    out = {
        "gold": "{name: driving-closed-loop}",
        "gold+filter": f"{{name: driving-closed-loop, safety_filter: {FILTER}}}",
    }
    for name, config in HIGHWAY.items():
        base = {"name": "driving-highway", "episodes": episodes, "seed": FIRST_EPISODE, **config}
        out[f"highway:{name}"] = flow(base)
        out[f"highway:{name}+filter"] = flow({**base, "safety_filter": FILTER})
    out["shadow:driving"] = "{name: driving-shadow, world: driving}"
    out["shadow:highway"] = flow(
        {"name": "driving-shadow", "world": "highway", "episodes": shadow_episodes, "seed": FIRST_EPISODE}
    )
    return out


# --- cells (each runs in a process of its own: ``--cell``) ----------------------------------------


def train_cell(work: Path, planner: str, seed: int, extra: Sequence[str] = ()) -> Path | None:
    """The planner's final weights for ``seed`` (trained once, kept under ``work``; a recipe in stages
    ends in its run folder); None for the base."""
    if PLANNERS[planner] is None:
        return None
    from fgrpo.core import stages
    from fgrpo.core.yaml_reading import load_yaml

    recipe, overrides = recipe_of(planner)
    written, _ = load_yaml(Path(recipe).read_text(), recipe)
    out = work / "runs" / f"{planner}-{seed}"
    if not (out / "finished").exists():
        command = [sys.executable, "-m", "fgrpo.core.cli", "compose", recipe, "--out", str(out), "--quiet"]
        command += ["--resume"] if out.exists() else []
        for item in stages.for_every_stage(written, [*overrides, *extra, f"seed={seed}"]):
            command += ["--set", item]
        subprocess.run(command, check=True)
        (out / "finished").write_text("")
    return sorted(out.glob("checkpoints/iter_*/trainable.safetensors"))[-1]


def evaluate(planner: str, weights: Path | None, evaluator: str, extra: Sequence[str] = ()) -> dict[str, float]:
    """One evaluation of the planner's weights (the base's without): the evaluator's metrics."""
    from safetensors.torch import load_file

    from fgrpo.core import evaluation

    # the guard watches a run's evaluations over time: one evaluation has nothing to watch; a recipe in
    # stages is judged with its first stage's keys: a later stage's weights are a whole network as well,
    # loaded into the base's, whose plan stays the safety filter's BC candidate
    file, own = recipe_of(planner)
    overrides = [*own, *extra, f"evaluator={evaluator}", "eval.guard=null", *TRAINING_STARTS_OFF]
    recipe = _bench.load_recipe(file, overrides)
    run = _bench.build(recipe)
    if weights is not None:
        run.learner.policy.load_trainable_state_dict(load_file(str(weights)))
    metrics = evaluation.gold_metrics(run, 0, None, None, [])
    out = {}
    for key, value in metrics.items():
        name = key.split("/", 2)[2] if key.startswith("gold/") else "/"
        if "/" not in name or name.startswith("filter/"):  # the overall figures, not those per type
            out[name] = float(value)
    return out


def run_cell(work: Path, planner: str, seed: int, name: str, evaluator: str, extra: Sequence[str] = ()) -> None:
    file = work / "cells" / f"{planner}-{seed}-{name.replace(':', '_')}.json"
    if file.exists():
        return
    weights = train_cell(work, planner, seed, extra)
    start = time.process_time()
    metrics = evaluate(planner, weights, evaluator, extra)
    row = {"planner": planner, "seed": seed, "evaluation": name, "metrics": metrics}
    row["cpu_s"] = time.process_time() - start
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(row))


# --- the table ---------------------------------------------------------------------------------------


def cell_text(values: Sequence[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def columns(name: str) -> tuple[str, ...]:
    """The figures of one evaluation in the table."""
    if name.startswith("shadow"):
        return ("ade", "collision")
    return (*METRICS, "filter/intervened") if name.endswith("+filter") else METRICS


def table(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    planners = [p for p in PLANNERS if any(r["planner"] == p for r in rows)]
    header = ["planner", "seeds"] + [f"{n} {m}" for n in names for m in columns(n)]
    body = []
    for planner in planners:
        mine = [r for r in rows if r["planner"] == planner]
        line: list[Any] = [planner, ",".join(sorted({str(r["seed"]) for r in mine}))]
        for n in names:
            for metric in columns(n):
                found = [r["metrics"][metric] for r in mine if r["evaluation"] == n and metric in r["metrics"]]
                line.append(cell_text(found))
        body.append(line)
    return _bench.table(header, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="where runs and results are kept (resumable)")
    parser.add_argument("--seeds", default="0,1,2", help="the recipes' seeds (the base has one)")
    parser.add_argument("--planners", default=",".join(PLANNERS), help=f"of {', '.join(PLANNERS)}")
    parser.add_argument("--episodes", type=int, default=300, help="highway-env episodes per configuration")
    parser.add_argument("--shadow-episodes", type=int, default=30, help="highway-env episodes of shadow mode")
    parser.add_argument("--only", default="", help="comma-separated evaluations (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="cells at once, each in its own process")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for all")
    parser.add_argument("--table", action="store_true", help="print the table of what is saved (no work)")
    parser.add_argument("--cell", nargs=4, metavar=("PLANNER", "SEED", "NAME", "EVALUATOR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell:
        planner, seed, name, evaluator = args.cell
        run_cell(args.work, planner, int(seed), name, evaluator, args.set)
        return 0
    every = evaluators(args.episodes, args.shadow_episodes)
    names = [n for n in args.only.split(",") if n] or list(every)
    unknown = [n for n in names if n not in every] + [p for p in args.planners.split(",") if p not in PLANNERS]
    if unknown:
        raise SystemExit(
            f"unknown evaluation(s) or planner(s): {', '.join(unknown)}; allowed: {', '.join([*every, *PLANNERS])}"
        )
    if not args.table:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        cells = [
            (p, s if PLANNERS[p] is not None else 0, n)
            for p in args.planners.split(",")
            for s in (seeds if PLANNERS[p] is not None else [0])
            for n in names
        ]
        # a planner's first cell trains it: its other cells wait for that one
        first = {(p, s): i for i, (p, s, _) in reversed(list(enumerate(cells)))}
        for group in (sorted(set(first.values())), [i for i in range(len(cells)) if i not in first.values()]):
            run_all([cells[i] for i in group], args, every)
    rows = [json.loads(f.read_text()) for f in sorted((args.work / "cells").glob("*.json"))]
    print(_bench.machine_line())
    print(table(rows, names))
    return 0


def run_all(cells: Sequence[tuple[str, int, str]], args: argparse.Namespace, every: dict[str, str]) -> None:
    pending, running = list(cells), []
    while pending or running:
        while pending and len(running) < args.jobs:
            planner, seed, name = pending.pop(0)
            command = [
                sys.executable,
                __file__,
                "--work",
                str(args.work),
                "--cell",
                planner,
                str(seed),
                name,
                every[name],
            ]
            command += [f"--set={item}" for item in args.set]
            running.append(subprocess.Popen(command))
        for proc in list(running):
            if proc.poll() is not None:
                running.remove(proc)
                if proc.returncode:
                    raise SystemExit(f"a cell failed ({proc.returncode}): {' '.join(proc.args)}")
        time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
