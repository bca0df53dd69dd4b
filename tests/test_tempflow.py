"""The ``tempflow`` sampler (TempFlow-GRPO): trajectory branching and noise-aware step weights."""

from __future__ import annotations

import math

import pytest
import torch

from _helpers import registration
from fgrpo.core import cli, registry
from fgrpo.core.protocols import StepBatch
from fgrpo.core.testing import SamplerConformance
from fgrpo.core.testing.toys import GaussianPolicy
from fgrpo.samplers.tempflow import TempFlowSampler

PROMPTS = ["a cat", "a dog"]


#: the entry point, where the editable install predates it (a fresh install registers it)
tempflow_registered = registration("sampler", "tempflow", TempFlowSampler)


class TestTempFlowSampler(SamplerConformance):
    sampler_name = "tempflow"
    sampler_params = {"steps": 6}
    bad_params = {"branch_range": [3, 9]}


class TestTempFlowSamplerOwnNoise(SamplerConformance):
    sampler_name = "tempflow"
    sampler_params = {"steps": 6, "branch_range": [1, 5], "share_noise": False, "kl_steps": "all"}


def naive_rollout(policy, prompts, group, steps, low, high, seed, eta=0.7):
    """Float64 from the paper's definitions: one seed per prompt, Euler x + dt v shared by the group
    up to the branching step k, there Flow-GRPO's SDE step (g = eta sqrt(sigma / (1 - sigma)),
    sigma == 1: 1 - sigmas[1] below; mean x (1 + g^2/(2 sigma) dt) + v (1 + g^2 (1 - sigma)/(2 sigma)) dt,
    x' = mean + g sqrt(-dt) eps) with each sample's own eps, then Euler to the end. The weight
    Norm(sigma_t sqrt(dt)) = s_k / mean(s_j, j in low .. high - 1). The draws in the sampler's
    order: k, the prompts' noise, the step's noise."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(low, high, (1,), generator=g).item())
    batch = len(prompts) * group
    x = torch.randn((len(prompts), *policy.shape), generator=g).double()
    sigmas = policy.sigmas(steps).double()
    mean_p = torch.stack([policy._prompt_mean(p) for p in prompts]).double()

    def std(i):
        sigma, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
        gt = eta * math.sqrt(sigma / (1 - (float(sigmas[1]) if sigma == 1 else sigma)))
        return gt, gt * math.sqrt(-dt)

    prefix = []
    for i in range(steps):
        n, cond = x.shape[0], mean_p if x.shape[0] != batch else mean_p.repeat_interleave(group, 0)
        if i == k:
            x = x.repeat_interleave(group, 0)
            cond = mean_p.repeat_interleave(group, 0)
            n = batch
        sigma, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
        with torch.no_grad():
            v = policy._velocity(x, torch.full((n,), sigma, dtype=torch.float64), cond)
        if i != k:
            x = x + dt * v
            if i < k:
                prefix.append(x.clone())
            continue
        eps = torch.randn(x.shape, generator=g, dtype=torch.float32).double()
        gt, s = std(i)
        one_minus = 1 - (float(sigmas[1]) if sigma == 1 else sigma)
        mean = x * (1 + eta**2 / (2 * one_minus) * dt) + v * (1 + eta**2 * (1 - sigma) / (2 * one_minus)) * dt
        before, x = x, mean + s * eps
        after = x
        logp = (-((x - mean) ** 2) / (2 * s**2) - math.log(s) - math.log(math.sqrt(2 * math.pi))).mean(dim=1)
    weight = std(k)[1] / (sum(std(j)[1] for j in range(low, high)) / (high - low))
    return k, before, after, x, logp, weight, prefix


@pytest.mark.parametrize("seed", range(4))
def test_matches_a_naive_float64_rollout_and_weight_from_the_paper(seed):
    policy = GaussianPolicy(shape=(6,))
    sampler = registry.create("sampler", "tempflow", steps=8, branch_range=[0, 7], kernel={"name": "sde", "eta": 0.7})
    traj = sampler.rollout(policy, PROMPTS, 3, generator=torch.Generator().manual_seed(seed))
    k, before, after, final, logp, weight, _ = naive_rollout(policy, PROMPTS, 3, 8, 0, 7, seed)
    assert traj.info["branch_step"] == k
    assert traj.step_index.tolist() == [[k]] * 6
    torch.testing.assert_close(traj.latents[:, 0].double(), before, atol=1e-6, rtol=0)
    torch.testing.assert_close(traj.next_latents[:, 0].double(), after, atol=1e-6, rtol=0)
    torch.testing.assert_close(traj.final.double(), final, atol=1e-6, rtol=0)
    torch.testing.assert_close(traj.log_probs[:, 0].double(), logp, atol=1e-6, rtol=0)
    assert traj.policy_weight is not None
    torch.testing.assert_close(traj.policy_weight.double(), torch.full((6, 1), weight).double(), atol=1e-6, rtol=0)


def test_weights_favour_high_noise_and_average_one():
    policy = GaussianPolicy(shape=(4,))
    sampler = registry.create("sampler", "tempflow", steps=10)
    seen = {}
    for seed in range(60):
        traj = sampler.rollout(policy, PROMPTS, 2, generator=torch.Generator().manual_seed(seed))
        seen[traj.info["branch_step"]] = float(traj.policy_weight[0, 0])
    assert sorted(seen) == list(range(9))  # default: every step but the last, as the reference
    ordered = [seen[k] for k in sorted(seen)]
    assert math.isclose(sum(ordered) / len(ordered), 1.0, rel_tol=1e-6)
    assert ordered[1] > ordered[-1]  # early (high-noise) steps weigh more than the last ones
    off = registry.create("sampler", "tempflow", steps=10, noise_weight=False)
    traj = off.rollout(policy, PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    assert traj.policy_weight.tolist() == [[1.0]] * 4


def test_one_transition_per_sample_at_its_branch_step_and_a_shared_prefix():
    policy = GaussianPolicy(shape=(2, 4, 4))
    for seed in range(12):
        sampler = registry.create("sampler", "tempflow", steps=10)
        traj = sampler.rollout(policy, PROMPTS, 4, generator=torch.Generator().manual_seed(seed))
        k = traj.info["branch_step"]
        assert traj.step_index.shape == (8, 1) and traj.step_index.tolist() == [[k]] * 8
        assert traj.latents.shape == (8, 1, 2, 4, 4) and traj.log_probs.shape == (8, 1)
        assert traj.info["phases"] == ["prefix"] * k + ["branch"] + ["suffix"] * (9 - k)
        # the prefix runs once per prompt, then one trajectory per sample from the branch on
        assert traj.info["nfe"] == {"prefix": 2 * k, "branch": 8, "suffix": 8 * (9 - k)}
        assert traj.info["shared_prefix_steps"] == k
        for p in range(2):  # the state at the branch is the same for the whole group ...
            group = traj.latents[4 * p : 4 * p + 4, 0]
            assert torch.equal(group, group[:1].expand_as(group))
            finals = traj.final[4 * p : 4 * p + 4]  # ... and the samples differ after it
            assert not torch.equal(finals[0], finals[1])


def test_shared_prefix_matches_the_naive_states():
    policy = GaussianPolicy(shape=(6,))
    sampler = registry.create("sampler", "tempflow", steps=8, branch_range=[3, 7])
    traj = sampler.rollout(policy, PROMPTS, 3, generator=torch.Generator().manual_seed(5))
    k, before, *_, prefix = naive_rollout(policy, PROMPTS, 3, 8, 3, 7, 5)
    assert len(prefix) == k >= 3
    torch.testing.assert_close(traj.latents[:, 0].double(), prefix[-1].repeat_interleave(3, 0), atol=1e-6, rtol=0)


def test_grpo_multiplies_the_recorded_weight_into_the_clipped_loss():
    """Hand computation: A = 1.5, ratio e^0.2 clipped to 1 + 0.1, the tempflow step's weight w as
    points/transitions.step_batch applies ``policy_weight`` (into the advantage): the step's loss
    is w * max(-A r, -A clip(r)) = w * -1.5 * 1.1."""
    traj = registry.create("sampler", "tempflow", steps=8).rollout(
        GaussianPolicy(shape=(2,)), PROMPTS[:1], 1, generator=torch.Generator().manual_seed(1)
    )
    w = float(traj.policy_weight[0, 0])
    assert w != 1.0
    objective = registry.create("objective", "grpo", clip_range=0.1, adv_clip=5.0)
    batch = StepBatch(
        log_prob=torch.tensor([0.2]),
        old_log_prob=torch.tensor([0.0]),
        advantages=torch.tensor([1.5]) * traj.policy_weight[:, 0],
        mean=torch.zeros(1, 2),
        old_mean=torch.zeros(1, 2),
        std=torch.ones(1),
        dt=torch.tensor([-0.1]),
    )
    assert objective(batch).metrics["policy_loss"].item() == pytest.approx(w * -1.5 * 1.1, abs=1e-6)


def test_check_passes_on_a_vector_recipe_with_tempflow(root, capsys):
    sets = ["--set", "sampler.name=tempflow", "--set", "train.iterations=2"]
    assert cli.main(["check", str(root / "recipes" / "vector.yaml"), *sets]) == 0
    assert "on-policy check passed" in capsys.readouterr().out
