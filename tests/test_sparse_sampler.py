"""The ``sparse`` sampler (UniRL's sparse SDE steps): ``trained`` stochastic, trained steps drawn
once per iteration for the whole batch from ``step_range``, Euler elsewhere."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from _helpers import registration
from fgrpo.core import cli, registry
from fgrpo.core.config import RecipeError
from fgrpo.core.seeding import derive_seed
from fgrpo.core.testing import SamplerConformance
from fgrpo.core.testing.toys import GaussianPolicy
from fgrpo.samplers.sparse import SparseSampler

PROMPTS = ["a cat", "a dog"]
#: HunyuanVideo 1.5's recipe: UniRL's 16 steps, timestep_fraction [0.0, 0.6], num_sde_steps 8
HUNYUAN = {"steps": 16, "trained": 8, "step_range": [0, 9], "kernel": {"name": "sde", "eta": 0.25}}


#: the entry point, where the editable install predates it (a fresh install registers it)
sparse_registered = registration("sampler", "sparse", SparseSampler)


class TestSparseSampler(SamplerConformance):
    sampler_name = "sparse"
    sampler_params = {"steps": 8, "trained": 3, "step_range": [1, 6], "kernel": "sde"}
    bad_params = {"trained": 6}  # more than the 5 steps of [1, 6)


class TestSparseSamplerSharedNoiseSeeded(SamplerConformance):
    sampler_name = "sparse"
    sampler_params = {"steps": 6, "trained": 2, "seed": 11, "share_noise": True}


class TestSparseSamplerCPSToTheEnd(SamplerConformance):
    """``cps`` has std 0 on its step to sigma' = 0: drawn there, that step is sampled, not trained."""

    sampler_name = "sparse"
    sampler_params = {"steps": 6, "trained": 2, "step_range": [3, 6], "kernel": "cps", "kl_steps": "all"}


def unirl_sde_indices(num_timesteps, timestep_fraction, num_sde_steps, step):
    """UniRL's ``AllSDEScheduler.get_sde_indices`` (unirl/utils/scheduler_utils.py 86-124 @ 1a7b501)
    and ``resolve_sde_indices`` (unirl/types/sampling.py 127: sorted), written out again."""
    start, end = timestep_fraction
    effective_start, effective_end = int(num_timesteps * start), int(num_timesteps * end)
    pool = list(range(effective_start, effective_end))
    if num_sde_steps is None or num_sde_steps >= len(pool):
        return sorted(set(pool))
    rng = np.random.default_rng(0 if step is None else int(step))
    chosen = rng.choice(pool, size=num_sde_steps, replace=False)
    return sorted(set(int(i) for i in chosen))


def test_draws_the_steps_unirl_draws_at_every_iteration():
    sampler = registry.create("sampler", "sparse", **HUNYUAN)
    for it in range(300):
        sampler.advance(it)
        assert sampler.state_dict()["drawn"] == unirl_sde_indices(16, (0.0, 0.6), 8, it), f"iteration {it}"


def test_hunyuan_draw_stays_in_steps_0_to_8_and_visits_each():
    sampler = registry.create("sampler", "sparse", **HUNYUAN)
    left_out = []
    for it in range(200):
        drawn = sampler.drawn_at(it)
        assert len(drawn) == 8 and len(set(drawn)) == 8 and all(0 <= i <= 8 for i in drawn)
        left_out += sorted(set(range(9)) - set(drawn))
    assert set(left_out) == set(range(9))  # the one step of 0..8 left out varies with the iteration


def test_the_drawn_steps_alone_are_noised_and_trained_for_every_sample():
    """The program: the kernel exactly at the drawn steps, Euler elsewhere; every sample of the
    iteration (whatever its rollout generator, as on another process) trains the same steps."""
    policy = GaussianPolicy(shape=(3,))
    for it in (0, 1, 5):
        drawn = unirl_sde_indices(16, (0.0, 0.6), 8, it)
        for process_seed in (0, 1):
            sampler = registry.create("sampler", "sparse", **HUNYUAN)
            sampler.advance(it)
            traj = sampler.rollout(policy, PROMPTS, 3, generator=torch.Generator().manual_seed(process_seed))
            assert traj.step_index.tolist() == [drawn] * 6
            assert traj.info["phases"] == ["sde" if i in drawn else "ode" for i in range(16)]
            assert traj.info["nfe"] == {"sde": 6 * 8, "ode": 6 * 8} and traj.info["drawn"] == drawn


def test_a_whole_range_is_noised_without_a_draw():
    """By hand: ``trained`` null or the range's size takes every step of [2, 5), at any iteration."""
    for trained in (None, 3):
        sampler = registry.create("sampler", "sparse", steps=6, step_range=[2, 5], trained=trained)
        for it in (0, 3, 99):
            assert sampler.drawn_at(it) == [2, 3, 4]
    assert registry.create("sampler", "sparse", steps=4).drawn_at(7) == [0, 1, 2, 3]  # default: [0, steps]


def test_a_seed_keys_the_draw_by_seed_and_iteration():
    seeded = registry.create("sampler", "sparse", **HUNYUAN, seed=3)
    other = registry.create("sampler", "sparse", **HUNYUAN, seed=4)
    draws = [seeded.drawn_at(it) for it in range(40)]
    for it, drawn in enumerate(draws):
        rng = np.random.default_rng(derive_seed(3, "sparse-steps", it))
        assert drawn == sorted(int(i) for i in rng.choice(list(range(9)), size=8, replace=False))
    assert draws != [other.drawn_at(it) for it in range(40)]
    assert draws != [unirl_sde_indices(16, (0.0, 0.6), 8, it) for it in range(40)]


def naive_rollout(policy, prompts, group, steps, drawn, eta, seed):
    """Float64 from UniRL's definitions (unirl/sde/kernels.py 207-236, FlowSDEStrategy; its
    HunyuanVideo 1.5 rollout, diffusion.py 513-531, passes eta at the drawn steps and 0, the Euler
    step x + dt v, elsewhere): std_dev_t = eta sqrt(sigma / (1 - sigma)) (sigma_max = sigmas[1] in
    the denominator at sigma 1), mean x (1 + std^2/(2 sigma) dt) + v (1 + std^2 (1 - sigma)/(2 sigma)) dt,
    x' = mean + std sqrt(-dt) eps; log-prob averaged over the sample's dims. The draws in the
    sampler's order: the initial noise, then each drawn step's noise."""
    g = torch.Generator().manual_seed(seed)
    batch = len(prompts) * group
    x = torch.randn((batch, *policy.shape), generator=g).double()
    sigmas = policy.sigmas(steps).double()
    mean_c = torch.stack([policy._prompt_mean(p) for p in prompts]).double().repeat_interleave(group, 0)
    before, after, logps = [], [], []
    for i in range(steps):
        sigma, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
        with torch.no_grad():
            v = policy._velocity(x, torch.full((batch,), sigma, dtype=torch.float64), mean_c)
        if i not in drawn:
            x = x + dt * v
            continue
        eps = torch.randn(x.shape, generator=g, dtype=torch.float32).double()
        std_t = eta * math.sqrt(sigma / (1 - (float(sigmas[1]) if sigma == 1 else sigma)))
        mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        s = std_t * math.sqrt(-dt)
        before.append(x)
        x = mean + s * eps
        after.append(x)
        logps.append((-((x - mean) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).mean(dim=1))
    return torch.stack(before, 1), torch.stack(after, 1), torch.stack(logps, 1), x


@pytest.mark.parametrize("it", [0, 4])
def test_matches_a_naive_float64_rollout_of_the_reference(it):
    policy = GaussianPolicy(shape=(5,))
    sampler = registry.create("sampler", "sparse", **HUNYUAN)
    sampler.advance(it)
    traj = sampler.rollout(policy, PROMPTS, 3, generator=torch.Generator().manual_seed(it))
    before, after, logp, final = naive_rollout(
        policy, PROMPTS, 3, 16, unirl_sde_indices(16, (0.0, 0.6), 8, it), 0.25, it
    )
    torch.testing.assert_close(traj.latents.double(), before, atol=1e-5, rtol=0)
    torch.testing.assert_close(traj.next_latents.double(), after, atol=1e-5, rtol=0)
    torch.testing.assert_close(traj.log_probs.double(), logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(traj.final.double(), final, atol=1e-5, rtol=0)


def test_resume_draws_what_the_uninterrupted_run_draws():
    """A sampler restored at iteration 37 (its state through JSON) and one that moved through
    every iteration agree from there on; the draw is a function of the iteration alone."""
    through = registry.create("sampler", "sparse", **HUNYUAN)
    for it in range(38):
        through.advance(it)
    restored = registry.create("sampler", "sparse", **HUNYUAN)
    restored.load_state_dict(json.loads(json.dumps(through.state_dict())))
    policy = GaussianPolicy(shape=(3,))
    a = through.rollout(policy, PROMPTS, 2, generator=torch.Generator().manual_seed(9))
    b = restored.rollout(policy, PROMPTS, 2, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a.final, b.final) and torch.equal(a.step_index, b.step_index)
    for it in range(38, 45):
        through.advance(it)
        restored.advance(it)
        assert through.state_dict() == restored.state_dict()


def test_bad_keys_and_a_foreign_state_are_refused_in_one_line():
    with pytest.raises(RecipeError, match=r"sampler.trained: got 10; allowed: <= the 9 steps of step_range \[0, 9\]"):
        registry.create("sampler", "sparse", **{**HUNYUAN, "trained": 10})
    with pytest.raises(RecipeError, match=r"sampler.step_range: got \[0, 17\]"):
        registry.create("sampler", "sparse", **{**HUNYUAN, "step_range": [0, 17]})
    sampler = registry.create("sampler", "sparse", **HUNYUAN)
    with pytest.raises(ValueError, match=r"saved drawn steps \[0, 1, 12\] are not 8 distinct ascending steps"):
        sampler.load_state_dict({"iteration": 3, "drawn": [0, 1, 12]})


def test_check_passes_on_a_vector_recipe_with_sparse(root, capsys):
    """``fgrpo check``: the first ratio of the update is 1 (the stored log-probs re-evaluate exactly)."""
    sets = ["--set", "sampler.name=sparse", "--set", "sampler.trained=3", "--set", "sampler.step_range=[0,6]"]
    assert cli.main(["check", str(root / "recipes" / "vector.yaml"), *sets, "--set", "train.iterations=2"]) == 0
    assert "on-policy check passed" in capsys.readouterr().out
