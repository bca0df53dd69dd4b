"""The ``flash`` sampler (Flash-GRPO): one stochastic, trained step per sample, Euler elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from _helpers import registration
from fgrpo.core import cli, registry
from fgrpo.core.testing import SamplerConformance
from fgrpo.core.testing.toys import GaussianPolicy
from fgrpo.samplers.flash import FlashSampler

PROMPTS = ["a cat", "a dog"]


#: the entry point, where the editable install predates it (a fresh install registers it)
flash_registered = registration("sampler", "flash", FlashSampler)


class TestFlashSampler(SamplerConformance):
    sampler_name = "flash"
    sampler_params = {"steps": 6, "kernel": "sde"}
    bad_params = {"step_range": [3, 9]}


class TestFlashSamplerWanSDE(SamplerConformance):
    sampler_name = "flash"
    sampler_params = {"steps": 6, "step_range": [1, 5], "share_noise": True}


def naive_rollout(policy, prompts, group, steps, low, high, seed):
    """Float64 from the reference's definitions (wan2_1_pipeline_with_logprob_sample.py): Euler
    x + dt v at every step but k, and at k the Wan SDE step with std_dev_t = sigma_min +
    (sigma_max - sigma_min) sigma, mean x (1 + std^2/(2 sigma) dt) + v (1 + std^2 (1 - sigma)/(2 sigma)) dt,
    x' = mean + std sqrt(-dt) eps; log-prob averaged over the sample's dims. The draws in the
    sampler's order: k, the initial noise, the step's noise."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(low, high, (1,), generator=g).item())
    batch = len(prompts) * group
    x = torch.randn((batch, *policy.shape), generator=g).double()
    sigmas = policy.sigmas(steps).double()
    cond = {"mean": torch.stack([policy._prompt_mean(p) for p in prompts]).double().repeat_interleave(group, 0)}
    sigma_max, sigma_min = float(sigmas[1]), float(sigmas[-1])
    for i in range(steps):
        sigma, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
        with torch.no_grad():
            v = policy._velocity(x, torch.full((batch,), sigma, dtype=torch.float64), cond["mean"])
        if i != k:
            x = x + dt * v
            continue
        eps = torch.randn(x.shape, generator=g, dtype=torch.float32).double()
        std_t = sigma_min + (sigma_max - sigma_min) * sigma
        mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        s = std_t * math.sqrt(-dt)
        before, x = x, mean + s * eps
        after = x
        logp = (-((x - mean) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))).mean(dim=1)
    return k, before, after, x, logp


@pytest.mark.parametrize("seed", range(4))
def test_matches_a_naive_float64_rollout_of_the_reference(seed):
    policy = GaussianPolicy(shape=(6,))
    sampler = registry.create("sampler", "flash", steps=8, step_range=[0, 4])
    traj = sampler.rollout(policy, PROMPTS, 3, generator=torch.Generator().manual_seed(seed))
    k, before, after, final, logp = naive_rollout(policy, PROMPTS, 3, 8, 0, 4, seed)
    assert traj.info["flash_step"] == k
    assert traj.step_index.tolist() == [[k]] * 6
    torch.testing.assert_close(traj.latents[:, 0].double(), before, atol=1e-6, rtol=0)
    torch.testing.assert_close(traj.final.double(), final, atol=1e-6, rtol=0)
    torch.testing.assert_close(traj.next_latents[:, 0].double(), after, atol=1e-6, rtol=0)
    torch.testing.assert_close(traj.log_probs[:, 0].double(), logp, atol=1e-6, rtol=0)


def test_one_transition_per_sample_at_the_drawn_step():
    policy = GaussianPolicy(shape=(2, 4, 4))
    seen = set()
    for seed in range(30):
        sampler = registry.create("sampler", "flash", steps=10, kernel="sde")
        traj = sampler.rollout(policy, PROMPTS, 4, generator=torch.Generator().manual_seed(seed))
        k = traj.info["flash_step"]
        seen.add(k)
        assert traj.step_index.shape == (8, 1) and traj.step_index.tolist() == [[k]] * 8
        assert traj.latents.shape == (8, 1, 2, 4, 4) and traj.log_probs.shape == (8, 1)
        assert traj.info["phases"] == ["prefix"] * k + ["flash"] + ["suffix"] * (9 - k)
        assert traj.info["nfe"] == {"prefix": 8 * k, "flash": 8, "suffix": 8 * (9 - k)}
    assert seen == set(range(5))  # default: uniform over the first steps // 2 steps, as the reference


def test_check_passes_on_a_vector_recipe_with_flash(root, capsys):
    sets = ["--set", "sampler.name=flash", "--set", "train.iterations=2"]
    assert cli.main(["check", str(root / "recipes" / "vector.yaml"), *sets]) == 0
    assert "on-policy check passed" in capsys.readouterr().out
