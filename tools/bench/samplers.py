#!/usr/bin/env python
"""The samplers side by side on the same model: NFE per sample and wall time per iteration.

    python tools/bench/samplers.py recipes/shapes.yaml --steps 10 --iterations 4
    python tools/bench/samplers.py recipes/shapes.yaml --steps 25 --only mixgrpo-flash --iterations 25

Variants (the recipe's model, reward, objective and batch; only the sampler changes):
``full`` (every step SDE and trained), ``fast`` with the shared ODE prefix on and off (and with
independent noise per sample where the installed ``fast`` sampler has ``share_noise``),
``mixgrpo`` (a 4-step window, ODE elsewhere) and ``mixgrpo-flash`` (DPM-Solver++(2M) on a
compressed schedule after the window). Their iterations are interleaved in one process.

Printed per variant: old-policy NFE per sample (the rollout, split by phase), training NFE per
sample (the update; the reference pass of a KL term included), wall time per iteration and its
ratio to ``full``. For ``fast`` the prefix NFE with and without sharing gives the measured cut,
against the expected (G - 1) / G.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import _bench  # noqa: E402 - beside this script: python puts a script's own folder first on sys.path


def variants(steps: int, kernel: str, fast_keys: set[str]) -> dict[str, str]:
    k = f"{{name: {kernel}}}"
    out = {
        "full": f"{{name: full, steps: {steps}, kernel: {k}}}",
        "fast": f"{{name: fast, steps: {steps}, window: 2, share_prefix: true, kernel: {k}}}",
        "fast-no-share": f"{{name: fast, steps: {steps}, window: 2, share_prefix: false, kernel: {k}}}",
    }
    if "share_noise" in fast_keys:
        out["fast-indep-noise"] = (
            f"{{name: fast, steps: {steps}, window: 2, share_noise: false, share_prefix: false, kernel: {k}}}"
        )
    window_end = max(4, steps - 2)
    out["mixgrpo"] = (
        f"{{name: mixgrpo, steps: {steps}, window: 4, window_end: {window_end}, shift_every: 1, kernel: {k}}}"
    )
    out["mixgrpo-flash"] = (
        f"{{name: mixgrpo, steps: {steps}, window: 4, window_end: {window_end}, shift_every: 1, flash: true, "
        f"flash_ratio: 0.4, kernel: {k}}}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default=str(_bench.ROOT / "recipes" / "shapes.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kernel", default="sde", help="the stochastic kernel of every sampler")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--skip", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    _bench.choose_threads()
    import attrs

    from fgrpo.core import registry

    fast_keys = {f.name for f in attrs.fields(registry.load("sampler", "fast"))}
    chosen = variants(args.steps, args.kernel, fast_keys)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    runs, batch = {}, {}
    for name, sampler in chosen.items():
        recipe = _bench.load_recipe(args.recipe, [*args.overrides, f"sampler={sampler}"])
        runs[name] = _bench.build(recipe)
        batch[name] = recipe.train.prompts_per_iteration * recipe.train.group_size
        group = recipe.train.group_size
    rows = _bench.interleave(runs, args.iterations, args.skip)

    print(
        f"{args.recipe}: {args.steps} steps, kernel {args.kernel}, group {group}; {args.iterations} iterations each "
        f"after {args.skip}, interleaved; {_bench.machine_line()}"
    )
    base = [m["time_iteration_s"] for m in rows.get("full", [])]
    table = []
    for name, metrics in rows.items():
        b = batch[name]
        old = statistics.mean(m["nfe_rollout"] for m in metrics) / b
        phases = sorted({k for m in metrics for k in m if k.startswith("nfe_rollout/")})
        split = ", ".join(f"{p.split('/')[1]} {statistics.mean(m.get(p, 0) for m in metrics) / b:.2f}" for p in phases)
        train = statistics.mean(m["nfe_train"] for m in metrics) / b
        it = [m["time_iteration_s"] for m in metrics]
        ratio = f"{_bench.paired_ratio(it, base):.3f}" if base and name != "full" else "1" if name == "full" else "-"
        table.append([name, f"{old:.2f}", split, f"{train:.2f}", _bench.spread(it), ratio])
    print(
        _bench.table(
            ["sampler", "old-policy NFE/sample", "by phase", "train NFE/sample", "s/iteration", "time/full"], table
        )
    )

    if "fast" in rows and "fast-no-share" in rows:
        shared = statistics.mean(m.get("nfe_rollout/prefix", 0) for m in rows["fast"])
        plain = statistics.mean(m.get("nfe_rollout/prefix", 0) for m in rows["fast-no-share"])
        if plain:
            print(
                f"fast: prefix NFE cut by the shared prefix {1 - shared / plain:.4f} (expected (G - 1)/G = "
                f"{(group - 1) / group:.4f})"
            )
    for name in ("mixgrpo", "mixgrpo-flash"):
        if name in rows:
            per_sample = [m["nfe_rollout"] / batch[name] for m in rows[name]]
            print(
                f"{name}: old-policy NFE per sample {min(per_sample):.2f}-{max(per_sample):.2f} of {args.steps} steps "
                f"over the windows drawn"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
