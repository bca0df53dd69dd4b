"""The references' semantics in the trainer: the zero-advantage filter, the EMA's global count,
evaluation on the sampler's schedule and guidance, and the refusals made at validation time."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from rich.console import Console

from fgrpo.core import cli, evaluation, rollout, update
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.building import build_run
from fgrpo.core.config import RecipeError
from fgrpo.core.hookspecs import hookimpl, plugin_manager
from fgrpo.core.protocols import Trajectory
from fgrpo.core.trainer import iteration

QUIET = Console(quiet=True)


def vector_recipe(root, *overrides):
    return recipe_mod.load(root / "recipes" / "vector.yaml", list(overrides))


# --- refusals at validation time ---------------------------------------------------------------


def test_guard_with_unnormalised_cps_is_refused_with_the_fix(root, capsys):
    with pytest.raises(RecipeError) as info:
        recipe_mod.load(root / "recipes" / "shapes.yaml", ["objective.name=grpo-guard", "objective.kl_beta=0.0"])
    assert [e.key for e in info.value.errors] == ["sampler.kernel.normalized_logprob"]
    assert "set sampler.kernel.normalized_logprob: true" in str(info.value)
    fixed = recipe_mod.load(
        root / "recipes" / "shapes.yaml",
        ["objective.name=grpo-guard", "objective.kl_beta=0.0", "sampler.kernel.normalized_logprob=true"],
    )
    assert fixed.data["objective"]["name"] == "grpo-guard"
    code = cli.main(["validate", str(root / "recipes" / "shapes.yaml"), "--set", "objective.name=grpo-guard"])
    assert code == 2 and "sampler.kernel.normalized_logprob" in capsys.readouterr().err


def test_flow_grpo_kl_with_cps_and_eval_guidance_without_cfg_are_refused(root):
    with pytest.raises(RecipeError) as info:
        recipe_mod.load(root / "recipes" / "shapes.yaml", ["objective.kl_form=flow_grpo"])
    assert [e.key for e in info.value.errors] == ["objective.kl_form"]
    assert recipe_mod.load(root / "recipes" / "vector.yaml", ["objective.kl_form=flow_grpo", "objective.kl_beta=0.1"])
    with pytest.raises(RecipeError) as info:
        vector_recipe(root, "eval.guidance_scale=4.5")  # the vector policy has no guidance
    assert [e.key for e in info.value.errors] == ["eval.guidance_scale"]
    assert recipe_mod.load(root / "recipes" / "shapes.yaml", ["eval.guidance_scale=2.0"]).eval.guidance_scale == 2.0


# --- the zero-advantage filter -----------------------------------------------------------------


def _gradients(run, traj, adv):
    """The gradient of the update's single optimizer step (the step itself is not taken)."""
    grads = []

    def capture():
        grads.append([p.grad.detach().clone() for p in run.learner.trainable])

    run.learner.optimizer.step = capture
    update.update(run, traj, adv, 0)
    assert len(grads) == 1
    return grads[0]


def _subset(traj: Trajectory, rows: torch.Tensor) -> Trajectory:
    fields = ("group_index", "step_index", "latents", "next_latents", "log_probs", "means", "stds", "final")
    return Trajectory(
        prompts=[traj.prompts[i] for i in rows.tolist()],
        cond=traj.cond[rows],
        sigmas=traj.sigmas,
        **{name: getattr(traj, name)[rows] for name in fields},
    )


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_dropped_samples_do_not_change_the_gradient(root, beta):
    recipe = vector_recipe(root, "train.minibatch_size=0", "train.max_grad_norm=0", f"objective.kl_beta={beta}")
    run = build_run(recipe, out_dir=None, console=QUIET, quiet=True)
    # one step of training first, so that the policy differs from the reference (the KL has a gradient)
    iteration(run, 0)
    traj = rollout.rollout(run, 1)
    adv = torch.randn(traj.batch_size, generator=torch.Generator().manual_seed(0))
    adv[:8] = 0.0  # a flat group
    adv[13] = 0.0
    kept = (adv != 0).nonzero().squeeze(1)
    dropped = _gradients(run, traj, adv)
    alone = _gradients(run, _subset(traj, kept), adv[kept])
    for a, b in zip(dropped, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # without the filter the zero-advantage samples dilute the policy gradient by k/n (flow_grpo
    # drops them): exactly that factor when there is no KL term
    everything = _gradients(
        attrs.evolve(run, recipe=attrs.evolve(recipe, train=attrs.evolve(recipe.train, drop_zero_advantage=False))),
        traj,
        adv,
    )
    if beta == 0.0:
        for a, b in zip(everything, alone, strict=True):
            torch.testing.assert_close(a, b * len(kept) / traj.batch_size, rtol=1e-5, atol=1e-7)
    else:
        assert any(
            (a - b * len(kept) / traj.batch_size).abs().max() > 1e-6 for a, b in zip(everything, alone, strict=True)
        )


def test_minibatches_shrink_with_the_kept_samples_and_a_flat_batch_skips_the_update(root):
    recipe = vector_recipe(root)  # 64 samples, minibatches of 16
    run = build_run(recipe, out_dir=None, console=QUIET, quiet=True)
    traj = rollout.rollout(run, 0)
    adv = torch.ones(traj.batch_size)
    adv[:24] = 0.0
    stats = update.update(run, traj, adv, 0)
    assert stats.samples == 40 and stats.optimizer_steps == 4  # 4 minibatches of 10, as flow_grpo keeps their number
    assert [len(m) for m in update.minibatches(torch.arange(40), 40, 64, 16, None)] == [10, 10, 10, 10]
    assert [len(m) for m in update.minibatches(torch.arange(64), 64, 64, 16, None)] == [16] * 4
    before = [p.detach().clone() for p in run.learner.trainable]
    stats = update.update(run, traj, torch.zeros(traj.batch_size), 1)
    assert stats.optimizer_steps == 0 and stats.samples == 0
    assert all(torch.equal(a, b) for a, b in zip(before, run.learner.trainable, strict=True))
    summary = update.summarize(stats)
    assert summary["optimizer_steps"] == 0 and summary["trained_samples"] == 0


def test_dropped_fraction_is_logged(root):
    run = build_run(vector_recipe(root, "train.group_size=2"), out_dir=None, console=QUIET, quiet=True)
    traj = rollout.rollout(run, 0)
    scores = {"target-distance": torch.tensor([1.0, 1.0] * 4 + [0.0, 1.0] * 4)}
    _, stats = rollout.advantages(run, traj, scores)
    assert stats["dropped_fraction"] == 0.5 and stats["zero_std_ratio"] == 0.5


# --- the EMA counts optimizer steps over the whole run -----------------------------------------


def test_ema_updates_at_global_steps_with_flow_grpo_warmup(root):
    # one optimizer step per iteration and ema_every 3: the EMA moves after global steps 3 and 6
    # (before the fix it counted within an iteration and never moved)
    recipe = vector_recipe(root, "train.minibatch_size=0", "train.ema_decay=0.9", "train.ema_every=3")
    run = build_run(recipe, out_dir=None, console=QUIET, quiet=True)
    moved = []
    for it in range(7):
        shadow = [s.clone() for s in run.learner.ema.shadow]
        iteration(run, it)
        changed = any(not torch.equal(a, b) for a, b in zip(shadow, run.learner.ema.shadow, strict=True))
        moved.append(changed)
        if changed:  # shadow <- shadow + (1 - min((1 + n)/(10 + n), 0.9)) (weights - shadow), n = global steps
            n = run.learner.optimizer_steps
            weight = 1 - min((1 + n) / (10 + n), 0.9)
            for old, new, p in zip(shadow, run.learner.ema.shadow, run.learner.trainable, strict=True):
                torch.testing.assert_close(new, old + weight * (p.detach() - old))
    assert moved == [False, False, True, False, False, True, False]
    assert run.learner.optimizer_steps == 7


def flow_grpo_ema(weights, accumulation, every, decay):
    """flow_grpo's EMA (flow_grpo/ema.py, stepped at train_sd3.py:959-960): ema.step(params,
    global_step) after every training minibatch; global_step counts optimizer steps, one per
    ``accumulation`` minibatches; ``weights[g]`` are the weights after g optimizer steps. It runs up
    to the minibatch before the next optimizer step (the last step's later updates included)."""
    ema = weights[0].clone()
    global_step = 0
    for minibatch in range(accumulation * len(weights) - 1):
        if (minibatch + 1) % accumulation == 0:
            global_step += 1  # accelerate's sync_gradients: the optimizer steps
        one_minus_decay = 1 - min((1 + global_step) / (10 + global_step), decay)
        if (global_step + 1) % every == 0:
            ema = ema + one_minus_decay * (weights[global_step] - ema)
    return ema


@pytest.mark.parametrize("accumulation, every", [(8, 8), (2, 8), (1, 8), (3, 1)])
def test_ema_flow_grpo_rule_is_its_per_minibatch_count(accumulation, every):
    """train.ema_rule: flow_grpo with ema_repeats = its minibatches per optimizer step gives flow_grpo's
    average; the default rule (once, every ema_every-th step) does not."""
    from fgrpo.core.ema import EMA

    weights = list(torch.randn(33, 5, generator=torch.Generator().manual_seed(0)).double())
    param = torch.nn.Parameter(weights[0].clone())
    ema = EMA([param], 0.9)
    plain = EMA([param], 0.9)
    for n in range(1, len(weights)):
        param.data.copy_(weights[n])
        if ema.due(n, every, "flow_grpo"):
            for _ in range(accumulation):
                ema.update(ema.warmup_decay(n))
        if plain.due(n, every):
            plain.update(plain.warmup_decay(n))
    expected = flow_grpo_ema(weights, accumulation, every, 0.9)
    torch.testing.assert_close(ema.shadow[0], expected, rtol=0, atol=1e-12)
    assert (plain.shadow[0] - expected).abs().max() > 1e-3


def test_ema_flow_grpo_rule_in_a_run(root):
    # one optimizer step per iteration: flow_grpo's rule moves after global steps 2 and 5 (ema_every 3),
    # twice each (ema_repeats 2): shadow <- w + d^2 (shadow - w)
    recipe = vector_recipe(
        root,
        "train.minibatch_size=0",
        "train.ema_decay=0.9",
        "train.ema_every=3",
        "train.ema_rule=flow_grpo",
        "train.ema_repeats=2",
    )
    run = build_run(recipe, out_dir=None, console=QUIET, quiet=True)
    moved = []
    for it in range(6):
        shadow = [s.clone() for s in run.learner.ema.shadow]
        iteration(run, it)
        moved.append(any(not torch.equal(a, b) for a, b in zip(shadow, run.learner.ema.shadow, strict=True)))
        if moved[-1]:
            d = min((1 + run.learner.optimizer_steps) / (10 + run.learner.optimizer_steps), 0.9)
            for old, new, p in zip(shadow, run.learner.ema.shadow, run.learner.trainable, strict=True):
                torch.testing.assert_close(new, p.detach() + d * d * (old - p.detach()))
    assert moved == [False, True, False, False, True, False]


def test_ema_and_its_count_survive_a_resume(root, tmp_path):
    from safetensors.torch import load_file

    recipe = str(root / "recipes" / "vector.yaml")
    sets = [
        "--set",
        "train.minibatch_size=0",
        "--set",
        "train.ema_decay=0.9",
        "--set",
        "train.ema_every=2",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        "train.iterations=5",
        "--set",
        "eval.every=0",
        "--quiet",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli.main(["compose", recipe, "--out", str(straight), *sets]) == 0

    class Crash:
        @hookimpl
        def fgrpo_iteration_end(self, run, iteration, metrics):
            if iteration == 3:  # after checkpoint 2 (an odd number of steps would lose the phase)
                raise KeyboardInterrupt

    pm = plugin_manager()
    pm.register(Crash(), name="crash")
    try:
        assert cli.main(["compose", recipe, "--out", str(resumed), *sets]) == 130
    finally:
        pm.unregister(name="crash")
    saved = json.loads((resumed / "checkpoints" / "last" / "state.json").read_text())
    assert saved["iteration"] == 2 and saved["optimizer_steps"] == 2
    assert cli.main(["compose", recipe, "--out", str(resumed), "--resume", *sets]) == 0
    a = load_file(str(straight / "checkpoints" / "last" / "ema.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "last" / "ema.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((resumed / "checkpoints" / "last" / "state.json").read_text())["optimizer_steps"] == 5


# --- evaluation: the sampler's schedule, its own guidance --------------------------------------


def test_evaluation_integrates_on_the_samplers_schedule(root):
    from fgrpo.samplers.schedules import Schedule

    recipe = vector_recipe(root, "sampler.schedule={type: shift, shift: 1.5}", "eval.steps=7")
    run = build_run(recipe, out_dir=None, console=QUIET, quiet=True)
    sigmas = evaluation.evaluation_sigmas(run)
    assert torch.equal(sigmas, Schedule(type="shift", shift=1.5)(7))
    assert not torch.equal(sigmas, run.learner.policy.sigmas(7))  # the model's own shift is 3
    default = build_run(vector_recipe(root, "eval.steps=7"), out_dir=None, console=QUIET, quiet=True)
    assert torch.equal(evaluation.evaluation_sigmas(default), default.learner.policy.sigmas(7))


def test_generate_is_the_euler_ode(root):
    from fgrpo.core import registry, tensors

    run = build_run(vector_recipe(root), out_dir=None, console=QUIET, quiet=True)
    policy, prompts = run.learner.policy, ["target 1 1", "target -1 0"]
    out = evaluation.generate(policy, prompts, 3, 6, torch.Generator().manual_seed(1))
    ode = registry.create("kernel", "euler")
    x = policy.initial_noise(6, torch.Generator().manual_seed(1))
    cond = tensors.repeat_interleave(policy.encode(prompts), 3)
    sigmas = policy.sigmas(6)
    for i in range(6):
        x = ode.step(policy.velocity(x, sigmas[i].expand(6), cond), x, sigmas, i).prev_sample
    assert torch.equal(out, policy.decode(x))


class _GuidedStub:
    """A policy whose velocity reports the guidance scale it was called with."""

    device = torch.device("cpu")
    evaluations_per_call = 1

    def __init__(self):
        self.guidance_scale = 1.0

    def encode(self, prompts):
        return torch.zeros(len(prompts), 1)

    def initial_noise(self, n, generator=None):
        return torch.zeros(n, 2)

    def sigmas(self, steps):
        return torch.linspace(1, 0, steps + 1)

    def velocity(self, x, sigma, cond):
        return torch.full_like(x, -self.guidance_scale)

    def decode(self, latents):
        return latents


def test_eval_guidance_scale_is_set_for_the_evaluation_only():
    policy = _GuidedStub()
    with evaluation.guidance(policy, 4.5):
        out = evaluation.generate(policy, ["a"], 2, 4, torch.Generator())
    assert torch.allclose(out, torch.full((2, 2), 4.5))  # integral of -v from 1 to 0
    assert policy.guidance_scale == 1.0
    with evaluation.guidance(policy, None):
        assert torch.allclose(evaluation.generate(policy, ["a"], 1, 4, torch.Generator()), torch.ones(1, 2))
    with pytest.raises(RecipeError, match="eval.guidance_scale"):
        with evaluation.guidance(object(), 2.0):
            pass
