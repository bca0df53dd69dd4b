"""Run N iterations of a recipe in this process (or under torchrun, in each of its processes) and
report what the data-parallel test compares. Usage: dp_worker.py RECIPE OUT.json N [KEY=VALUE ...]"""

from __future__ import annotations

import json
import sys

import torch
from rich.console import Console

from fgrpo.core import launch
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.building import build_run
from fgrpo.core.opening import end_process_group
from fgrpo.core.trainer import iteration


def main() -> None:
    path, out, n, *overrides = sys.argv[1:]
    parallel = launch.start(cpu=True)
    acc = parallel.accelerator
    recipe = recipe_mod.load(path, overrides)
    run = build_run(recipe, out_dir=None, console=Console(quiet=True), quiet=True, parallel=parallel)
    rewards, identical = [], []
    for it in range(int(n)):
        metrics = iteration(run, it)
        rewards.append(metrics["reward_mean"])
        flat = torch.cat([p.detach().reshape(-1) for p in run.learner.trainable])
        every_rank = acc.gather(flat[None])
        identical.append(all(torch.equal(every_rank[0], row) for row in every_rank))
    if acc.is_main_process:
        flat = torch.cat([p.detach().reshape(-1) for p in run.learner.trainable])
        with open(out, "w") as fh:
            json.dump(
                {"processes": acc.num_processes, "rewards": rewards, "identical": identical, "weights": flat.tolist()},
                fh,
            )
    end_process_group()


if __name__ == "__main__":
    main()
