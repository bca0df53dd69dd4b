"""The ``fast`` sampler: a random window, an ODE prefix shared by the group."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fgrpo.core import registry

PROMPTS = ["a cat", "a dog", "a fox"]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("cfg", [None, 4.5], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize("kernel", ["sde", "cps"])
def test_shared_prefix_is_bit_identical_to_recomputing_it(make_policy, cfg, kernel):
    group, steps = 4, 10
    for seed in range(4):
        runs = {}
        for share in (True, False):
            policy = make_policy(shape=(2, 4, 4), guidance=cfg)
            sampler = registry.create(
                "sampler", "fast", steps=steps, share_noise=True, share_prefix=share, kernel=kernel
            )
            runs[share] = (sampler.rollout(policy, PROMPTS, group, generator=gen(seed)), policy)
        (a, pa), (b, pb) = runs[True], runs[False]
        start = a.info["window_start"]
        assert start == b.info["window_start"]
        for field in ("latents", "next_latents", "log_probs", "means", "stds", "final", "step_index"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        # NFE: the prefix costs prompts rows per step instead of prompts x group
        epc = 2 if cfg else 1
        p, batch = len(PROMPTS), len(PROMPTS) * group
        assert b.nfe == steps * batch * epc
        assert a.nfe == (start * p + (steps - start) * batch) * epc
        assert b.nfe - a.nfe == start * (group - 1) * p * epc
        assert pa.rows == [p] * start + [batch] * (steps - start)
        assert pb.rows == [batch] * steps
        assert a.info["nfe"]["prefix"] == start * p * epc and a.info["shared_prefix_steps"] == start


def test_group_starts_the_window_from_one_state(policy):
    sampler = registry.create("sampler", "fast", steps=10, window_range=[3, 5], share_noise=True)
    traj = sampler.rollout(policy, PROMPTS, 3, generator=gen())
    assert traj.step_index.tolist() == [[3, 4]] * 9
    assert traj.info["phases"] == ["prefix"] * 3 + ["window"] * 2 + ["suffix"] * 5
    at_start = traj.latents[:, 0]
    for g in range(3):
        rows = at_start[3 * g : 3 * g + 3]
        assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])
    assert not torch.equal(at_start[0], at_start[3])
    assert not torch.equal(traj.final[0], traj.final[1])  # the window makes the group diverge


def test_window_lies_inside_window_range_as_flow_grpo_draws_it(policy):
    # flow_grpo: start = random.randint(low, high - window), inclusive, so the whole window lies in
    # [low, high). Default range: [0, steps // 2] (flow_grpo's Fast configs). 10 steps, window 3:
    # starts 0..2, trained steps 0..4 (never 5 or 6)
    sampler = registry.create("sampler", "fast", steps=10, window=3)
    assert sampler.bounds == (0, 5) and sampler.start_range == (0, 2)
    g = gen(0)
    starts = Counter(sampler.rollout(policy, ["a"], 2, generator=g).info["window_start"] for _ in range(150))
    assert set(starts) == {0, 1, 2}
    assert min(starts.values()) >= 35  # 50 expected per value
    # window 2 of 10 steps: starts 0..3
    two = registry.create("sampler", "fast", steps=10, window=2)
    seen = {two.rollout(policy, ["a"], 2, generator=gen(s)).info["window_start"] for s in range(60)}
    assert seen == {0, 1, 2, 3}
    custom = registry.create("sampler", "fast", steps=10, window=3, window_range=[2, 8])
    for s in range(60):
        steps = custom.rollout(policy, ["a"], 2, generator=gen(s)).step_index
        assert steps.min() >= 2 and steps.max() <= 7
    seen = {custom.rollout(policy, ["a"], 2, generator=gen(s)).info["window_start"] for s in range(60)}
    assert seen == set(range(2, 6))


def test_window_range_fits_a_window_wider_than_half(policy):
    # 4 steps, window 3: steps // 2 = 2 cannot hold the window; the default range widens to [0, 3]
    sampler = registry.create("sampler", "fast", steps=4, window=3)
    assert sampler.start_range == (0, 0)
    for seed in range(10):
        traj = sampler.rollout(policy, ["a"], 2, generator=gen(seed))
        assert traj.step_index.tolist() == [[0, 1, 2]] * 2


def test_independent_noise_gives_each_sample_its_own_start(make_policy):
    # flow_grpo same_latent: false (the default): every sample of a group has its own noise and prefix
    policy = make_policy(shape=(2, 3))
    sampler = registry.create("sampler", "fast", steps=10, window_range=[0, 2])
    assert sampler.share_noise is False
    traj = sampler.rollout(policy, PROMPTS, 4, generator=gen())
    # the window starts at step 0, so the first trained state is the initial noise: the window
    # start is drawn first, then one noise per sample (12 draws), all distinct
    g = gen()
    torch.randint(0, 1, (1,), generator=g)
    expected = policy.initial_noise(12, generator=g)
    assert torch.equal(traj.latents[:, 0], expected)
    assert len({tuple(row.flatten().tolist()) for row in expected}) == 12
    assert traj.info["shared_prefix_steps"] == 0
    # later window: no shared prefix, the prefix runs per sample and the group starts apart
    policy.rows.clear()
    later = registry.create("sampler", "fast", steps=10, window_range=[3, 5], share_noise=False)
    traj = later.rollout(policy, PROMPTS, 4, generator=gen())
    assert policy.rows == [12] * 10
    assert not torch.equal(traj.latents[0, 0], traj.latents[1, 0])
    # with a shared noise the G samples of a prompt start the window from one state
    shared = registry.create("sampler", "fast", steps=10, window_range=[3, 5], share_noise=True)
    shared = shared.rollout(policy, PROMPTS, 4, generator=gen())
    assert torch.equal(shared.latents[0, 0], shared.latents[1, 0])


def test_cps_window_on_the_last_step_drops_it(policy):
    # window [3, 5) of 5 steps: step 4 goes to sigma' = 0, where cps has std 0 -> sampled, not trained
    sampler = registry.create("sampler", "fast", steps=5, window=2, window_range=[3, 5], kernel="cps")
    traj = sampler.rollout(policy, ["a"], 2, generator=gen())
    assert traj.step_index.tolist() == [[3], [3]]
    assert (traj.stds > 0).all()


def test_final_ode_on_a_window_that_reaches_the_last_step(policy):
    # window [8, 10) of 10 steps with final: ode -> step 9 becomes an untrained Euler step
    sampler = registry.create("sampler", "fast", steps=10, window_range=[8, 10], final="ode")
    traj = sampler.rollout(policy, ["a"], 2, generator=gen())
    assert traj.step_index.tolist() == [[8]] * 2 and traj.info["final"] == "ode"
    x0 = registry.create("sampler", "fast", steps=10, window_range=[8, 10], final="x0")
    traj = x0.rollout(policy, ["a"], 2, generator=gen())
    assert traj.step_index.tolist() == [[8, 9]] * 2
    x, sigma = traj.latents[:, -1], traj.sigmas[9]
    v = policy.velocity(x, sigma.repeat(2), traj.cond)
    assert torch.equal(traj.final, x - sigma * v)
