"""Group advantages and multi-reward aggregation on hand-computed groups."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core.advantages import combine, group_advantages

D64 = torch.float64


def t(values, dtype=D64):
    return torch.tensor(values, dtype=dtype)


def idx(values):
    return torch.tensor(values, dtype=torch.long)


def test_hand_computed_groups_use_population_std():
    # Group 7: [1, 3], mean 2, population std 1 -> +-1 / 1.0001 (the unbiased std would give 0.707).
    # Group 2: [0, 0, 4, 4], mean 2, population std 2 -> +-2 / 2.0001.
    adv, stats = group_advantages(t([1.0, 3.0, 0.0, 0.0, 4.0, 4.0]), idx([7, 7, 2, 2, 2, 2]))
    a, b = 1 / 1.0001, 2 / 2.0001
    torch.testing.assert_close(adv, t([-a, a, -b, -b, b, b]))
    assert stats["zero_std_ratio"] == 0.0
    assert stats["reward_mean"] == pytest.approx(2.0)
    assert stats["reward_std"] == pytest.approx(math.sqrt(3.0))  # deviations^2 sum 18 / 6


def test_flat_and_single_groups_give_exact_zeros():
    # Group 0: three equal rewards (0.1 is not exact in binary: the mean may round), group 1: one
    # sample, group 2: [1, 2] -> +-0.5 / 0.5001.
    rewards = t([0.1, 0.1, 0.1, 0.3, 1.0, 2.0])
    for global_std in (False, True):
        adv, stats = group_advantages(rewards, idx([0, 0, 0, 1, 2, 2]), global_std=global_std)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[:4], torch.zeros(4, dtype=D64))
        assert stats["zero_std_ratio"] == pytest.approx(2 / 3)
    adv, _ = group_advantages(rewards, idx([0, 0, 0, 1, 2, 2]))
    torch.testing.assert_close(adv[4:], t([-0.5 / 0.5001, 0.5 / 0.5001]))
    adv, stats = group_advantages(t([5.0]), idx([0]))
    assert adv.tolist() == [0.0] and stats["zero_std_ratio"] == 1.0


def test_global_std():
    # Same batch as the first test; std of all six rewards = sqrt(3), means stay per group.
    adv, _ = group_advantages(t([1.0, 3.0, 0.0, 0.0, 4.0, 4.0]), idx([7, 7, 2, 2, 2, 2]), global_std=True)
    a, b = 0.5773169377806823, 1.1546338755613645  # 1 / (sqrt 3 + 1e-4), 2 / (sqrt 3 + 1e-4)
    torch.testing.assert_close(adv, t([-a, a, -b, -b, b, b]))


# Two groups of two. a = [0, 1 | 2, 2], b = [10, 30 | 0, 20], weights a: 2, b: 0.1.
REWARDS = {"a": t([0.0, 1.0, 2.0, 2.0]), "b": t([10.0, 30.0, 0.0, 20.0])}
WEIGHTS = {"a": 2.0, "b": 0.1}
GROUPS = idx([0, 0, 1, 1])


def test_combine_reward_sum():
    # weighted sum [1, 5 | 4, 6]: group std 2 and 1.
    adv, stats = combine(REWARDS, WEIGHTS, GROUPS, mode="reward_sum")
    torch.testing.assert_close(adv, t([-2 / 2.0001, 2 / 2.0001, -1 / 1.0001, 1 / 1.0001]))
    assert stats["reward_mean"] == pytest.approx(4.0)
    assert stats["reward_mean/a"] == pytest.approx(1.25) and stats["reward_mean/b"] == pytest.approx(15.0)
    assert stats["reward_std/b"] == pytest.approx(math.sqrt(125.0))
    assert stats["zero_std_ratio"] == 0.0


def test_combine_advantage_sum():
    # a -> [-+0.5/0.5001 | 0, 0] (group 1 flat), b -> [-+10/10.0001 | -+10/10.0001];
    # 2 * a + 0.1 * b.
    adv, stats = combine(REWARDS, WEIGHTS, GROUPS, mode="advantage_sum")
    first, second = 2.099599079994003, 0.09999900000999991
    torch.testing.assert_close(adv, t([-first, first, -second, second]))
    assert stats["zero_std_ratio"] == 0.0  # group 1 is flat for a only
    adv, stats = combine({"a": REWARDS["a"]}, {"a": 1.0}, GROUPS, mode="advantage_sum")
    assert stats["zero_std_ratio"] == 0.5 and torch.equal(adv[2:], torch.zeros(2, dtype=D64))


def test_shuffled_order_gives_the_same_per_sample_result():
    g = torch.Generator().manual_seed(0)
    groups = torch.arange(4).repeat_interleave(6) * 11 + 3  # any ids, not 0..n-1
    rewards = {"a": torch.rand(24, generator=g, dtype=D64), "b": torch.rand(24, generator=g, dtype=D64)}
    perm = torch.randperm(24, generator=g)
    for global_std in (False, True):
        adv, stats = group_advantages(rewards["a"], groups, global_std=global_std)
        adv_p, stats_p = group_advantages(rewards["a"][perm], groups[perm], global_std=global_std)
        torch.testing.assert_close(adv_p, adv[perm])
        assert stats_p == pytest.approx(stats)
        for mode in ("reward_sum", "advantage_sum"):
            adv, _ = combine(rewards, {"a": 1.0, "b": 0.5}, groups, mode=mode, global_std=global_std)
            shuffled = {k: v[perm] for k, v in rewards.items()}
            adv_p, _ = combine(shuffled, {"a": 1.0, "b": 0.5}, groups[perm], mode=mode, global_std=global_std)
            torch.testing.assert_close(adv_p, adv[perm])


def test_float32_and_float64_inputs():
    values = [0.25, 0.5, 0.75, 0.1, 0.1, 0.9]
    groups = idx([0, 0, 0, 1, 1, 1])
    adv64, stats64 = group_advantages(t(values), groups)
    adv32, stats32 = group_advantages(t(values, torch.float32), groups)
    assert adv64.dtype == D64 and adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.double(), adv64, rtol=1e-6, atol=1e-6)
    assert stats32 == pytest.approx(stats64, rel=1e-6)
    adv_bool, _ = group_advantages(torch.tensor([True, False, True, True]), idx([0, 0, 1, 1]))
    assert adv_bool.dtype == torch.get_default_dtype() and adv_bool[2:].tolist() == [0.0, 0.0]
    mixed, _ = combine({"a": t(values, torch.float32), "b": t(values)}, {"a": 1.0, "b": 1.0}, groups)
    assert mixed.dtype == D64


def test_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        group_advantages(t([1.0, 2.0]), idx([0, 0, 1]))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(t([1.0, float("nan")]), idx([0, 0]))
    with pytest.raises(ValueError, match="same rewards"):
        combine(REWARDS, {"a": 1.0}, GROUPS)
    with pytest.raises(ValueError, match="mode"):
        combine(REWARDS, WEIGHTS, GROUPS, mode="sum")
