#!/usr/bin/env python
"""How much a run slows down when another CPU-bound process shares its cores.

    python tools/bench/contention.py recipes/bench/tiny_sd3_jpeg.yaml --iterations 12 --repeats 2
    python tools/bench/contention.py RECIPE --external 'flow_grpo=cd ../fg && python scripts/train_sd3.py ...'

Each measured run trains the recipe (``fgrpo compose``, a fresh process) quietly and beside one
single-threaded busy loop (``--busy`` of them), under several thread policies:

- ``fgrpo``: what ``fgrpo`` chooses by itself (no environment variable set by the user);
- ``torch``: torch's own defaults (``FGRPO_THREADS=torch``: every core, spin-waiting threads);
- ``passive``: torch's thread count with ``OMP_WAIT_POLICY=PASSIVE`` (threads never spin);
- ``1-thread``: ``OMP_NUM_THREADS=1``.

An ``--external NAME=COMMAND`` is another implementation run the same way: its command must
append one JSON line per iteration with ``total_s`` (or ``time_iteration_s``) to the file named by
``$BENCH_TIMES``. Conditions and policies are interleaved over ``--repeats`` rounds; the figure
of a run is the median time per iteration after the first ``--skip``. The slowdown factor is
busy / quiet (median over rounds, each pair measured back to back).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _bench  # noqa: E402 - beside this script: python puts a script's own folder first on sys.path

POLICIES = {
    "fgrpo": {},
    "torch": {"FGRPO_THREADS": "torch"},
    "passive": {"FGRPO_THREADS": "torch", "OMP_WAIT_POLICY": "PASSIVE"},
    "1-thread": {"OMP_NUM_THREADS": "1"},
}
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "FGRPO_THREADS",
    "FGRPO_THREADS_CHOSEN",
    "MKL_NUM_THREADS",
    "GOMP_SPINCOUNT",
)


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    env.update({"HF_HUB_OFFLINE": "1", **extra})
    return env


def iteration_times(path: Path) -> list[float]:
    times = []
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            value = row.get("time_iteration_s", row.get("total_s"))
            if isinstance(value, (int, float)):
                times.append(float(value))
    return times


def start_busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def measure(
    command: list[str] | str, env: dict[str, str], times_file: Path, busy: int, skip: int, shell: bool = False
) -> float:
    """Median seconds per iteration of one run of ``command`` beside ``busy`` busy loops."""
    loops = start_busy(busy)
    try:
        done = subprocess.run(command, env=env, shell=shell, capture_output=True, text=True)
    finally:
        stop(loops)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {command}\n{done.stderr[-2000:]}")
    times = iteration_times(times_file)[skip:]
    if not times:
        raise SystemExit(f"run wrote no iteration times: {command}")
    return _bench.median(times)


def fgrpo_command(recipe: str, out: Path, iterations: int, overrides: list[str]) -> list[str]:
    exe = Path(sys.executable).with_name("fgrpo")
    sets = [f"--set={o}" for o in [f"train.iterations={iterations}", "eval.every=0", *overrides]]
    return [str(exe), "compose", recipe, "--out", str(out), "--quiet", *sets]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="first iterations of a run not counted")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over every policy and condition")
    parser.add_argument("--busy", type=int, default=1, help="single-threaded busy loops beside the run")
    parser.add_argument("--policies", default="fgrpo,torch,passive,1-thread", help=f"from {', '.join(POLICIES)}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--external", action="append", default=[], metavar="NAME=COMMAND")
    args = parser.parse_args(argv)

    subjects: list[tuple[str, object]] = [(p, POLICIES[p]) for p in args.policies.split(",") if p]
    subjects += [(name, command) for name, command in (e.split("=", 1) for e in args.external)]
    results: dict[str, dict[str, list[float]]] = {name: {"quiet": [], "busy": []} for name, _ in subjects}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for k, (name, how) in enumerate(subjects):
                conditions = (0, args.busy) if (r + k) % 2 == 0 else (args.busy, 0)
                for busy in conditions:
                    run_dir = Path(tmp) / f"{name}-{r}-{busy}"
                    if isinstance(how, dict):
                        command, shell = fgrpo_command(args.recipe, run_dir, args.iterations, args.overrides), False
                        env, times = clean_env(how), run_dir / "metrics.jsonl"
                    else:
                        times = Path(tmp) / f"{name}-{r}-{busy}.jsonl"
                        command, shell = how, True
                        env = clean_env({"BENCH_TIMES": str(times), "BENCH_EPOCHS": str(args.iterations)})
                    seconds = measure(command, env, times, busy, args.skip, shell=shell)
                    results[name]["busy" if busy else "quiet"].append(seconds)
                    print(
                        f"  round {r + 1} {name} {'busy' if busy else 'quiet'}: {seconds:.3f} s/iteration", flush=True
                    )

    print(f"{args.recipe}: {args.busy} busy loop(s) on {os.cpu_count()} CPUs; {_bench.machine_line()}")
    rows = []
    for name, res in results.items():
        factor = _bench.paired_ratio(res["busy"], res["quiet"])
        rows.append(
            [name, f"{_bench.median(res['quiet']):.3f}", f"{_bench.median(res['busy']):.3f}", f"x{factor:.2f}"]
        )
    print(_bench.table(["policy", "quiet s/it", "busy s/it", "slowdown"], rows))
    names = list(results)
    if len(names) > 1:
        base = names[0]
        for name in names[1:]:
            for cond in ("quiet", "busy"):
                ratio = _bench.paired_ratio(results[base][cond], results[name][cond])
                print(f"{cond}: {base}/{name} time per iteration {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
