"""The ``full`` sampler: every step stochastic; which of them are trained."""

from __future__ import annotations

import pytest
import torch

from fgrpo.core import registry


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_timestep_fraction_trains_the_first_steps_in_order(policy):
    # flow_grpo: 10 steps, fraction 0.99 -> int(9.9) = 9 trained steps, 0..8
    sampler = registry.create("sampler", "full", steps=10, timestep_fraction=0.99)
    traj = sampler.rollout(policy, ["a", "b"], 2, generator=gen())
    assert traj.step_index.tolist() == [list(range(9))] * 4
    assert traj.nfe == 10 * 4  # every step is still sampled (with the kernel)
    assert traj.info["phases"] == ["sde"] * 10


def test_random_subset_is_drawn_per_sample_from_the_generator(policy):
    # DanceGRPO: fraction 0.6 of 10 steps = 6 steps, a different random subset for each sample
    sampler = registry.create("sampler", "full", steps=10, timestep_fraction=0.6, random_subset=True)
    traj = sampler.rollout(policy, ["a", "b"], 4, generator=gen(1))
    rows = traj.step_index.tolist()
    assert all(len(set(r)) == 6 and r == sorted(r) and 0 <= r[0] and r[-1] <= 9 for r in rows)
    assert len({tuple(r) for r in rows}) > 1
    again = sampler.rollout(policy, ["a", "b"], 4, generator=gen(1))
    assert torch.equal(again.step_index, traj.step_index)
    assert torch.equal(again.final, traj.final)


def test_share_noise_gives_a_group_one_start(make_policy):
    policy = make_policy()
    shared = registry.create("sampler", "full", steps=4, share_noise=True)
    traj = shared.rollout(policy, ["a", "b"], 3, generator=gen())
    first = traj.latents[:, 0]  # the initial noise
    assert torch.equal(first[0], first[1]) and torch.equal(first[0], first[2])
    assert not torch.equal(first[0], first[3])
    assert not torch.equal(traj.next_latents[0, 0], traj.next_latents[1, 0])  # then they diverge
    independent = registry.create("sampler", "full", steps=4).rollout(policy, ["a", "b"], 3, generator=gen())
    assert not torch.equal(independent.latents[0, 0], independent.latents[1, 0])


def test_cps_step_to_zero_is_never_trained(policy):
    # cps has std sigma' * sin(eta pi / 2): 0 on the last step, which goes to sigma' = 0
    sigmas = policy.sigmas(5)
    assert sigmas[-1] == 0
    sampler = registry.create("sampler", "full", steps=5, kernel="cps")
    traj = sampler.rollout(policy, ["a"], 3, generator=gen())
    assert traj.step_index.tolist() == [[0, 1, 2, 3]] * 3
    assert (traj.stds > 0).all()
    subset = registry.create("sampler", "full", steps=5, kernel="cps", random_subset=True)
    for seed in range(10):
        traj = subset.rollout(policy, ["a"], 3, generator=gen(seed))
        assert traj.num_trained_steps == 4 and (traj.step_index < 4).all()
    # the explicit schedule of a recipe behaves the same
    explicit = registry.create(
        "sampler", "full", steps=3, kernel="cps", schedule={"type": "explicit", "values": [1.0, 0.6, 0.2, 0.0]}
    )
    traj = explicit.rollout(policy, ["a"], 2, generator=gen())
    assert traj.step_index.tolist() == [[0, 1]] * 2


def test_default_fraction_is_flow_grpo_099(policy):
    # flow_grpo's configs: timestep_fraction 0.99 -> 10 steps train 0..8, the sharp sigma -> 0 step is left out
    sampler = registry.create("sampler", "full", steps=10)
    assert sampler.timestep_fraction == 0.99
    assert sampler.rollout(policy, ["a"], 2, generator=gen()).step_index.tolist() == [list(range(9))] * 2


def _last_velocity(policy, traj):
    x = traj.latents[:, -1]
    sigma = traj.sigmas[traj.step_index[:, -1]]
    return x, sigma, policy.velocity(x, sigma, traj.cond)


def test_final_x0_decodes_the_last_steps_predicted_x0(make_policy):
    # DanceGRPO decodes pred_original = x - sigma v of the last step; the dance kernel defaults to it
    policy = make_policy(shape=(2, 3))
    sampler = registry.create("sampler", "full", steps=6, timestep_fraction=1.0, kernel={"name": "dance", "eta": 0.3})
    traj = sampler.rollout(policy, ["a", "b"], 2, generator=gen(5))
    assert traj.info["final"] == "x0" and traj.step_index[0, -1] == 5  # the last step is still trained
    x, sigma, v = _last_velocity(policy, traj)
    assert torch.equal(traj.final, x - sigma.reshape(-1, 1, 1) * v)
    # the kernel's own x0_hat: its mean is x + dt v + eta^2/2 (x + (1 - sigma) v) dt / sigma with dt = -sigma
    # (sigma' = 0), i.e. x - sigma v - eta^2/2 (x + (1 - sigma) v): x0_hat = mean + eta^2/2 (x + (1 - sigma) v)
    out = sampler.kernel.step(v, x, traj.sigmas, traj.step_index[:, -1], prev_sample=traj.next_latents[:, -1])
    s = sigma.reshape(-1, 1, 1)
    torch.testing.assert_close(traj.final, out.mean + 0.5 * 0.3**2 * (x + (1 - s) * v))
    # same rollout decoding the noisy sample: identical up to the last step, final = its action
    noisy = registry.create(
        "sampler", "full", steps=6, timestep_fraction=1.0, final="sample", kernel={"name": "dance", "eta": 0.3}
    ).rollout(policy, ["a", "b"], 2, generator=gen(5))
    assert torch.equal(noisy.next_latents, traj.next_latents)
    assert torch.equal(noisy.final, noisy.next_latents[:, -1])
    assert (noisy.final - traj.final).abs().max() > 1e-3


def test_final_ode_makes_the_last_step_deterministic_and_untrained(make_policy):
    policy = make_policy(shape=(3,))
    sampler = registry.create("sampler", "full", steps=5, timestep_fraction=1.0, final="ode")
    traj = sampler.rollout(policy, ["a"], 2, generator=gen(2))
    assert traj.step_index.tolist() == [[0, 1, 2, 3]] * 2
    # the last step is x' = x + dt v from sigma_4 to 0, i.e. x - sigma_4 v = the predicted x0
    x4 = traj.next_latents[:, -1]
    sigma = traj.sigmas[4].repeat(2)
    v = policy.velocity(x4, sigma, traj.cond)
    torch.testing.assert_close(traj.final, x4 - traj.sigmas[4] * v)
    # the sde kernel's reference is the noisy sample
    default = registry.create("sampler", "full", steps=5, timestep_fraction=1.0).rollout(
        policy, ["a"], 2, generator=gen(2)
    )
    assert default.info["final"] == "sample" and torch.equal(default.final, default.next_latents[:, -1])


def reference_trained_steps(steps: int, fraction: float, keys: torch.Tensor) -> list[list[int]]:
    """Pref-GRPO's (and DanceGRPO's) choice, written as its train_flux.py does it (:622-689): the
    rollout's last step is sliced off (``[:, :-1]``), each sample permutes the remaining steps
    (``perms[i]``, here the argsort of ``keys``) and trains the first ``int(len * fraction)``."""
    kept = list(range(steps))[:-1]
    train_timesteps = int(len(kept) * fraction)
    rows = []
    for row in keys:
        perm = row.argsort().tolist()
        rows.append(sorted(kept[j] for j in perm[:train_timesteps]))
    return rows


def test_ignore_last_trains_int_of_the_other_steps_as_pref_grpo(policy):
    # Pref-GRPO's FLUX script: 25 steps, fraction 0.6, the last step sliced off: int(24 x 0.6) = 14
    # steps of 0..23 per sample (without ignore_last: int(25 x 0.6) = 15 of 0..24)
    sampler = registry.create("sampler", "full", steps=25, timestep_fraction=0.6, random_subset=True, ignore_last=True)
    assert sampler.num_trained == 14
    traj = sampler.rollout(policy, ["a", "b"], 3, generator=gen(4))
    rows = traj.step_index.tolist()
    assert all(len(set(r)) == 14 and max(r) <= 23 for r in rows)
    assert traj.nfe == 25 * 6  # the last step is still sampled
    # the same draw as the reference's permutation of the 24 kept steps
    ours = sampler.trained_steps(list(range(25)), 6, gen(9))
    keys = torch.rand((6, 24), generator=gen(9))  # the keys our draw makes: one per kept step
    assert ours.tolist() == reference_trained_steps(25, 0.6, keys)
    plain = registry.create("sampler", "full", steps=25, timestep_fraction=0.6, random_subset=True)
    assert plain.num_trained == 15


def test_ignore_last_draws_every_kept_step_equally_often(policy):
    sampler = registry.create("sampler", "full", steps=25, timestep_fraction=0.6, random_subset=True, ignore_last=True)
    drawn = sampler.trained_steps(list(range(25)), 4000, gen(3))
    counts = torch.bincount(drawn.flatten(), minlength=25).double()
    assert counts[24] == 0
    expected = 4000 * 14 / 24  # each of 24 steps is in a uniform 14-subset with probability 14/24
    sd = (4000 * (14 / 24) * (10 / 24)) ** 0.5
    assert ((counts[:24] - expected).abs() < 5 * sd).all()


def test_ignore_last_in_order_trains_the_first_steps(policy):
    # without random_subset: the first int(9 x 0.6) = 5 steps of the 9 kept
    sampler = registry.create("sampler", "full", steps=10, timestep_fraction=0.6, ignore_last=True)
    assert sampler.rollout(policy, ["a"], 2, generator=gen()).step_index.tolist() == [[0, 1, 2, 3, 4]] * 2
    # fraction 1: every step but the last (flow_grpo reaches the same with 0.99 on 10 steps)
    every = registry.create("sampler", "full", steps=10, timestep_fraction=1.0, ignore_last=True)
    assert every.rollout(policy, ["a"], 1, generator=gen()).step_index.tolist() == [list(range(9))]


def test_ignore_last_refuses_a_fraction_that_trains_nothing():
    from fgrpo.core.config import RecipeError

    with pytest.raises(RecipeError, match=r"int\(3 \* 0.3\) = 0 trained steps.*>= 0.333333 for 3 trainable"):
        registry.create("sampler", "full", steps=4, timestep_fraction=0.3, ignore_last=True)
    with pytest.raises(RecipeError, match="sampler.ignore_last: got true with steps 1"):
        registry.create("sampler", "full", steps=1, timestep_fraction=1.0, ignore_last=True)
