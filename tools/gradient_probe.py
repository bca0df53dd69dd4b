"""Does the update's direction raise the expected reward? A finite-difference probe of the policy
gradient a recipe's objective computes.

The probe rolls out one batch (``train.prompts_per_iteration`` x ``train.group_size``), computes
the objective's gradient g on it exactly as the update does (every trained step, no optimizer),
then moves the trainable weights by +-h g / |g| and measures the mean reward of ``--batches``
fresh batches with the same noise at each point (common random numbers, so differences of a few
1e-5 are real). A correct estimator raises the reward along -g (descent of the loss); a random
direction of the same size is the control.

Measured on the driving world (docs/planners.md): with a deterministic last step (cps, whose
last step has std 0, or any sampler that leaves a step untrained) the direction lowers a
smoothness reward to first order, because the score-function estimator ignores how the
deterministic steps' network changes; with the whole chain stochastic and trained
(``timestep_fraction: 1.0`` with a kernel that has a std at every step) it raises it.

    python tools/gradient_probe.py recipes/driving-nft.yaml --set "reward={name: driving-comfort}" \
        --set "objective={name: grpo, clip_range: 0.01, kl_beta: 0.02}" \
        --set sampler.name=full --set sampler.timestep_fraction=1.0 \
        --set "sampler.kernel={name: correlated, base: {name: sde, eta: 0.3}, length: 3.0}"

(the driving recipe itself now trains with DiffusionNFT on ODE rollouts; the overrides give back the
Flow-GRPO set-up these figures were measured on)
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console

from fgrpo.core import recipe as recipe_mod
from fgrpo.core import rollout, scoring
from fgrpo.core.building import build_run
from fgrpo.core.points import transitions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--steps", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3], help="step sizes h (weight-space norm)"
    )
    parser.add_argument("--batches", type=int, default=3, help="fresh batches per measurement")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    recipe = recipe_mod.load(
        args.recipe, [*args.overrides, "eval.every=0", "log.trackers=[]", "train.drop_zero_advantage=false"]
    )
    run = build_run(recipe, out_dir=None, console=Console(quiet=True), quiet=True)
    params = run.learner.trainable

    def reward() -> float:
        values = []
        for k in range(args.batches):
            traj = rollout.rollout(run, 10_000 + k)
            scores, _ = scoring.decode_and_score(run, traj, "probe")
            total = sum(spec.weight * scores[spec.label] for spec in run.recipe.rewards)
            values.append(total.mean())
        return torch.stack(values).mean().item()

    traj = rollout.rollout(run, 0)
    scores, _ = scoring.decode_and_score(run, traj, "probe")
    adv, _ = rollout.advantages(run, traj, scores)
    ref = transitions.reference(run, traj, torch.arange(traj.batch_size))
    run.learner.optimizer.zero_grad(set_to_none=True)
    for rows, cols in transitions.pair_batches(traj, torch.arange(traj.batch_size), run.recipe.train.micro_batch_size):
        batch, _ = transitions.step_batch(run, traj, adv, rows, cols, ref)
        (run.objective(batch).loss * len(rows) / (traj.batch_size * traj.num_trained_steps)).backward()
    grad = [p.grad.detach().clone() for p in params]
    saved = [p.detach().clone() for p in params]
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grad))
    noise = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    noise_norm = torch.sqrt(sum(n.pow(2).sum() for n in noise))

    def at(direction: list[torch.Tensor], scale: float) -> float:
        with torch.no_grad():
            for p, s, d in zip(params, saved, direction, strict=True):
                p.copy_(s + scale * d)
        return reward()

    base = reward()
    print(f"reward {base:.5f} at the weights; |g| = {norm:.3e}")
    print("h        along -g    along +g    random")
    for h in args.steps:
        down = at(grad, -h / norm) - base
        up = at(grad, h / norm) - base
        rand = at(noise, h / noise_norm) - base
        print(f"{h:<8g} {down:+.5f}    {up:+.5f}    {rand:+.5f}")
    at(grad, 0.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
