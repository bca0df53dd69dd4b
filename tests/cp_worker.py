"""One iteration of a recipe (rollout, score, advantages, one update) in this process or under
torchrun, reporting what the context-parallel test compares: the rollout's latents and log-probs
(one copy per share of the batch, in process order), the advantages, the gradient of the update's
optimizer step, the weights after it and the evaluation's mean reward.
Usage: cp_worker.py RECIPE OUT.json [KEY=VALUE ...]"""

from __future__ import annotations

import json
import sys

import torch
from rich.console import Console

from fgrpo.core import launch, rollout, scoring, update
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.building import build_run
from fgrpo.core.composing import accelerate_summary
from fgrpo.core.opening import end_process_group
from fgrpo.core.trainer import run_evaluation


def main() -> None:
    path, out, *overrides = sys.argv[1:]
    parallel = launch.start(cpu=True)
    acc = parallel.accelerator
    run = build_run(recipe_mod.load(path, overrides), out_dir=None, console=Console(quiet=True), parallel=parallel)
    before = flat(run)
    run.sampler.advance(0)
    traj = rollout.rollout(run, 0)
    scores, _ = scoring.decode_and_score(run, traj, "the batch of iteration 0")
    adv, _ = rollout.advantages(run, traj, scores)
    update.update(run, traj, adv, 0)
    evaluated = run_evaluation(run, 0)  # the main process's group evaluates together

    def shares(t: torch.Tensor) -> list[float]:
        return parallel.one_per_share(acc.gather(t.contiguous())).reshape(-1).tolist()

    weights = flat(run)
    every_rank = acc.gather(weights[None])
    report = {
        "processes": acc.num_processes,
        "replicas": parallel.replicas,
        "summary": accelerate_summary(run),  # the start-up line
        "latents": shares(traj.latents),
        "final": shares(traj.final),
        "log_probs": shares(traj.log_probs),
        "advantages": shares(adv),
        "weights": weights.tolist(),
        # the last optimizer step's gradient as the step used it (Adam's first step hardly depends on its scale)
        "gradients": torch.cat([p.grad.reshape(-1) for p in run.learner.trainable]).tolist(),
        "identical": all(torch.equal(every_rank[0], row) for row in every_rank),
        "eval_reward": evaluated.get("eval/reward_mean"),
        "moved": float((weights - before).abs().max()),  # the update changed the weights
    }
    if acc.is_main_process:
        with open(out, "w") as fh:
            json.dump(report, fh)
    end_process_group()


def flat(run) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in run.learner.trainable])


if __name__ == "__main__":
    main()
