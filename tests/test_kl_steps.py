"""``kl_steps: all`` (the KL over every step of the chain): a windowed sampler records its
deterministic steps too, booked as the stochastic kernel's step at the visited state with policy
weight 0; the policy loss is the window's alone, exactly; the update stays on-policy."""

from __future__ import annotations

import torch
from rich.console import Console

from fgrpo.core import recipe as recipe_mod
from fgrpo.core.building import build_run
from fgrpo.core.rollout import advantages, rollout
from fgrpo.core.scoring import decode_and_score
from fgrpo.core.update import update

QUIET = Console(quiet=True)


def run_with(root, *overrides: str):
    recipe = recipe_mod.load(
        root / "recipes" / "vector.yaml",
        [
            "sampler={name: fast, steps: 8, window: 2, window_range: [0, 4], kernel: {name: sde, eta: 0.7}}",
            "log.trackers=[]",
            "eval.every=0",
            *overrides,
        ],
    )
    return build_run(recipe, out_dir=None, console=QUIET, quiet=True)


def one_update(run):
    traj = rollout(run, 0)
    scores, _ = decode_and_score(run, traj, "test")
    adv, _ = advantages(run, traj, scores)
    stats = update(run, traj, adv, 0)
    return traj, stats


def test_every_step_is_recorded_with_the_window_alone_in_the_policy_loss(root):
    run = run_with(root, "sampler.kl_steps=all")
    traj = rollout(run, 0)
    window = traj.info["window"]
    assert traj.step_index[0].tolist() == list(range(8))  # every step (sde has a std at each)
    weight = traj.policy_weight[0]
    assert weight.tolist() == [1.0 if i in window else 0.0 for i in range(8)]
    # an ODE step is booked as the kernel's step from its state: its action's log-prob re-evaluates exactly
    i = next(i for i in range(8) if i not in window)
    with torch.no_grad():
        v = run.learner.policy.velocity(traj.latents[:, i], traj.sigmas[traj.step_index[:, i]], traj.cond)
    again = run.sampler.kernel.step(
        v, traj.latents[:, i], traj.sigmas, traj.step_index[:, i], prev_sample=traj.next_latents[:, i]
    )
    assert torch.equal(again.log_prob, traj.log_probs[:, i]) and torch.equal(again.mean, traj.means[:, i])
    scores, _ = decode_and_score(run, traj, "test")
    adv, _ = advantages(run, traj, scores)
    assert float(update(run, traj, adv, 0).first_ratio_deviation) == 0.0


def test_without_a_kl_the_update_is_the_windows_and_with_one_it_is_not(root):
    """Adam's steps do not depend on the gradient's scale (the window's loss is averaged over 4x the
    steps with kl_steps: all), so without a KL both update the same (gradient clipping off, an Adam
    epsilon too small to matter)."""
    weights = {}
    for kl_steps in ("trained", "all"):
        for beta in (0.0, 0.5):
            run = run_with(
                root,
                f"sampler.kl_steps={kl_steps}",
                f"objective.kl_beta={beta}",
                "train.max_grad_norm=0",
                "train.adam_eps=1e-30",
            )
            one_update(run)
            weights[kl_steps, beta] = torch.cat(
                [p.detach().reshape(-1) for p in run.learner.policy.trainable_parameters()]
            )
    torch.testing.assert_close(weights["all", 0.0], weights["trained", 0.0], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(weights["all", 0.5], weights["trained", 0.5], rtol=1e-4, atol=1e-6)
