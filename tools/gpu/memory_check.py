#!/usr/bin/env python
"""tools/memory.py's estimate against what one GPU actually allocates.

    python tools/gpu/memory_check.py RECIPE [--iterations 1] [--set KEY=VALUE ...]

Runs ``--iterations`` trainer iterations of RECIPE in this one process on the GPU (data parallel
with one process: the ``ddp`` row of ``tools/memory.py RECIPE --gpus 1``), then prints
``torch.cuda.max_memory_allocated`` next to the estimate's total and its parts. The recipe's
``model.path`` must be loadable here (a local folder, or a hub id in the cache); shrink the run
with ``--set`` (``train.prompts_per_iteration=1``, ``train.group_size=2``, ``sampler.steps=4``)
to fit a quick check. Exits 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

GIB = 1024**3


def _memory_tool():
    spec = importlib.util.spec_from_file_location("memory", Path(__file__).resolve().parents[1] / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("memory_check: no CUDA device; this script measures GPU memory", file=sys.stderr)
        return 2
    from rich.console import Console

    from fgrpo.core import recipe as recipe_mod
    from fgrpo.core.building import build_run
    from fgrpo.core.trainer import iteration

    memory = _memory_tool()
    data, problem = memory.read_recipe(args.recipe, args.overrides)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    estimate = memory.estimate(data, 1)["kinds"]["ddp"]
    recipe = recipe_mod.load(args.recipe, [*args.overrides, "model.device=cuda", "eval.every=0"])
    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        run = build_run(recipe, out_dir=Path(out), console=Console(quiet=True), quiet=True)
        for it in range(args.iterations):
            iteration(run, it)
    peak = torch.cuda.max_memory_allocated()
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in estimate.items() if k != "total")
    print(
        f"measured peak {peak / GIB:.2f} GiB; estimated {estimate['total'] / GIB:.2f} GiB ({parts}); ratio "
        f"{estimate['total'] / peak:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
