"""The on-policy check (``fgrpo check``): one iteration, one batch, one gradient step, and the
largest |ratio - 1| of the stored actions' re-evaluated log-probs before the first optimizer step,
which is exactly 0 when rollout and update agree; when it is not, the usual suspects, each tested."""

from __future__ import annotations

import attrs
import torch
from rich.console import Console

from fgrpo.core import rollout, tensors
from fgrpo.core.building import build_run
from fgrpo.core.recipe import Recipe
from fgrpo.core.run import Run
from fgrpo.core.trainer import iteration


def first_ratio_check(recipe: Recipe, console: Console | None = None) -> tuple[float, Run]:
    """One iteration, one batch, one gradient step: the largest |ratio - 1| of the stored actions'
    re-evaluated log-probs before the first optimizer step (0 when rollout and update agree). A
    batch with nothing to update is followed by the next, up to :data:`ATTEMPTS`. Without
    ``console`` it says nothing."""
    console = console if console is not None else Console(quiet=True)
    cfg = attrs.evolve(recipe.train, iterations=ATTEMPTS, minibatch_size=0, inner_epochs=1, drop_zero_advantage=False)
    checked = attrs.evolve(recipe, train=cfg, eval=attrs.evolve(recipe.eval, every=0))
    run = build_run(checked, out_dir=None, console=console, quiet=True)
    run.checking = True  # forward-process points: the first update's predictions are compared with the old policy's
    for it in range(ATTEMPTS):
        # an objective that trains on pairs or non-flat groups only (DPO) may have nothing to
        # update in a batch whose groups all score alike: draw the next batch
        metrics = iteration(run, it)
        if "first_ratio_deviation" in metrics:
            return metrics["first_ratio_deviation"], run
    raise RuntimeError(f"fgrpo check: {ATTEMPTS} batches in a row had nothing to update (every group scored alike)")


#: batches ``fgrpo check`` draws before it gives up finding one with something to update
ATTEMPTS = 8


@torch.no_grad()
def diagnose(run: Run) -> list[str]:
    """Why re-evaluated log-probs differ from the rollout's: the usual suspects, each tested."""
    cfg = run.recipe.train
    found = []
    if cfg.rollout_precision != "same":
        dtype = next(iter(run.learner.trainable)).dtype
        found.append(
            f"the rollout ran under {cfg.rollout_precision} autocast (train.rollout_precision) while the update "
            f"runs in {str(dtype).replace('torch.', '')}: different dtypes give different velocities"
        )
    run.sampler.advance(0)
    traj = rollout.rollout(run, 0)
    if traj.num_trained_steps:
        x, sigma = traj.latents[:, 0], traj.sigmas[traj.step_index[:, 0]]
    else:  # forward-process points: the finished samples half re-noised
        noise = torch.randn(traj.final.shape, generator=torch.Generator().manual_seed(0)).to(traj.final.device)
        x, sigma = (
            0.5 * traj.final.float() + 0.5 * noise,
            torch.full((traj.batch_size,), 0.5, device=traj.final.device),
        )
    a = run.learner.policy.velocity(x, sigma, traj.cond)
    b = run.learner.policy.velocity(x, sigma, traj.cond)
    if not torch.equal(a, b):
        found.append(
            "the policy is not deterministic: two identical velocity calls differ (dropout? non-deterministic "
            "kernels?)"
        )
    one = run.learner.policy.velocity(x[:1], sigma[:1], tensors.index(traj.cond, slice(0, 1)))
    if not torch.equal(one, a[:1]):
        found.append(
            "batch composition changes the network's output: the update evaluates (sample, step) pairs in "
            "forward passes of a different size than the rollout (train.micro_batch_size, train.rollout_prompts)"
        )
    if not found and traj.num_trained_steps:
        found.append(
            "the kernel's log-prob of the stored action disagrees with the rollout: check the sampler's sigmas and "
            "step indices"
        )
    elif not found:
        found.append(
            "the old policy's predictions differ from the update's at the same points: check that the objective's old "
            "policy starts at the current weights"
        )
    return found
