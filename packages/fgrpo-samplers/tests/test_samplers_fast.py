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
            sampler = registry.create("sampler", "fast", steps=steps, share_prefix=share, kernel=kernel)
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
    sampler = registry.create("sampler", "fast", steps=10, window_start_range=[3, 4])
    traj = sampler.rollout(policy, PROMPTS, 3, generator=gen())
    assert traj.step_index.tolist() == [[3, 4]] * 9
    assert traj.info["phases"] == ["prefix"] * 3 + ["window"] * 2 + ["suffix"] * 5
    at_start = traj.latents[:, 0]
    for g in range(3):
        rows = at_start[3 * g : 3 * g + 3]
        assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])
    assert not torch.equal(at_start[0], at_start[3])
    assert not torch.equal(traj.final[0], traj.final[1])  # the window makes the group diverge


def test_window_start_distribution_covers_the_range(policy):
    # default range [0, steps // 2) = [0, 5), drawn once per rollout from the rollout's generator
    sampler = registry.create("sampler", "fast", steps=10, window=2)
    g = gen(0)
    starts = Counter(sampler.rollout(policy, ["a"], 2, generator=g).info["window_start"] for _ in range(150))
    assert set(starts) == {0, 1, 2, 3, 4}
    assert min(starts.values()) >= 15  # 30 expected per value
    custom = registry.create("sampler", "fast", steps=10, window=3, window_start_range=[2, 8])
    seen = {custom.rollout(policy, ["a"], 2, generator=gen(s)).info["window_start"] for s in range(60)}
    assert seen == set(range(2, 8))


def test_window_start_never_lets_the_window_overflow(policy):
    # 4 steps, window 3: the default range is cut to [0, 2)
    sampler = registry.create("sampler", "fast", steps=4, window=3)
    assert sampler.start_range == (0, 2)
    for seed in range(10):
        traj = sampler.rollout(policy, ["a"], 2, generator=gen(seed))
        assert traj.step_index.max() <= 3


def test_cps_window_on_the_last_step_drops_it(policy):
    # window [3, 5) of 5 steps: step 4 goes to sigma' = 0, where cps has std 0 -> sampled, not trained
    sampler = registry.create("sampler", "fast", steps=5, window=2, window_start_range=[3, 4], kernel="cps")
    traj = sampler.rollout(policy, ["a"], 2, generator=gen())
    assert traj.step_index.tolist() == [[3], [3]]
    assert (traj.stds > 0).all()
