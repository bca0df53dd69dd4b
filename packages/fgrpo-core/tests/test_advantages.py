"""Group advantages and multi-reward aggregation on hand-computed groups."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core.advantages import combine, group_advantages, total_reward

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


def test_combine_reward_product():
    # a = [0, 1 | 2, 2] ** 2 times b = [10, 30 | 0, 20] ** 0.1: group 0 [0, 30 ** 0.1], group 1 [0, 4 * 20 ** 0.1]
    adv, stats = combine(REWARDS, WEIGHTS, GROUPS, mode="reward_product")
    top = (30.0**0.1, 4 * 20.0**0.1)
    expected = [s * (v / 2) / (v / 2 + 1e-4) for v in top for s in (-1, 1)]
    torch.testing.assert_close(adv, t(expected))
    assert stats["reward_mean"] == pytest.approx((top[0] + top[1]) / 4)
    assert torch.equal(total_reward(REWARDS, WEIGHTS, "reward_product"), t([0.0, top[0], 0.0, top[1]]))
    with pytest.raises(ValueError, match=r"^reward 'b' gave -1; train.advantage: reward_product takes rewards >= 0"):
        combine({"a": REWARDS["a"], "b": t([1.0, -1.0, 0.0, 2.0])}, WEIGHTS, GROUPS, mode="reward_product")


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
        for mode in ("reward_sum", "advantage_sum", "reward_product"):
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


# --- the references' other normalisations -----------------------------------------------------


def test_ungrouped_uses_the_batch_mean_and_std():
    # flow_grpo per_prompt_stat_tracking: False -> (r - mean(all)) / (np.std(all) + 1e-4);
    # rewards [1, 3, 0, 0, 4, 4]: mean 2, population std sqrt(3)
    rewards = t([1.0, 3.0, 0.0, 0.0, 4.0, 4.0])
    adv, stats = group_advantages(rewards, idx([7, 7, 2, 2, 2, 2]), per_prompt=False)
    torch.testing.assert_close(adv, (rewards - 2.0) / (math.sqrt(3.0) + 1e-4))
    assert stats["zero_std_ratio"] == 0.0  # still about the prompt groups
    # a flat prompt group is not flat in the batch: its samples keep their advantage
    adv, stats = group_advantages(t([1.0, 1.0, 0.0, 2.0]), idx([0, 0, 1, 1]), per_prompt=False)
    torch.testing.assert_close(adv, t([0.0, 0.0, -1.0, 1.0]) / (math.sqrt(0.5) + 1e-4))
    assert stats["zero_std_ratio"] == 0.5
    # a flat batch: exact zeros
    adv, _ = group_advantages(t([0.3, 0.3, 0.3]), idx([0, 1, 2]), per_prompt=False, unbiased=True)
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_dancegrpo_mixgrpo_normalisation():
    # use_group: (r - group mean) / (torch std, unbiased, + 1e-8); use_group False: the batch's
    rewards = t([1.0, 3.0, 0.0, 0.0, 4.0, 4.0])
    adv, _ = group_advantages(rewards, idx([7, 7, 2, 2, 2, 2]), unbiased=True, eps=1e-8)
    s7, s2 = math.sqrt(2.0), math.sqrt(16 / 3)  # unbiased std of [1, 3] and of [0, 0, 4, 4]
    torch.testing.assert_close(adv, t([-1 / s7, 1 / s7, -2 / s2, -2 / s2, 2 / s2, 2 / s2]))
    for group in (t([1.0, 3.0]), t([0.0, 0.0, 4.0, 4.0])):
        reference = (group - group.mean()) / (group.std() + 1e-8)  # the MixGRPO/DanceGRPO line
        ours, _ = group_advantages(group, idx([0] * len(group)), unbiased=True, eps=1e-8)
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-15)
    ungrouped, _ = group_advantages(rewards, idx([7, 7, 2, 2, 2, 2]), per_prompt=False, unbiased=True, eps=1e-8)
    torch.testing.assert_close(ungrouped, (rewards - rewards.mean()) / (rewards.std() + 1e-8), rtol=0, atol=1e-15)


def test_population_vs_unbiased_size_at_g8():
    # the measured size of the difference: sqrt(8/7) = 1.069x larger with the unbiased-free estimator
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(8, generator=g, dtype=D64)
    pop, _ = group_advantages(rewards, idx([0] * 8), eps=1e-4)
    unb, _ = group_advantages(rewards, idx([0] * 8), unbiased=True, eps=1e-8)
    ratio = (pop / unb).mean().item()
    assert ratio == pytest.approx(math.sqrt(8 / 7), rel=1e-3) and 1.068 < ratio < 1.070


def test_combine_passes_the_options():
    rewards = {"a": t([0.0, 1.0, 2.0, 4.0])}
    adv, _ = combine(rewards, {"a": 1.0}, idx([0, 0, 1, 1]), per_prompt=False, unbiased=True, eps=1e-8)
    r = rewards["a"]
    torch.testing.assert_close(adv, (r - r.mean()) / (r.std() + 1e-8))
    # grouped, unbiased: [0, 1] -> +-0.5 / sqrt(0.5); [2, 4] -> +-1 / sqrt(2)
    expected = t(
        [
            -0.5 / (math.sqrt(0.5) + 1e-8),
            0.5 / (math.sqrt(0.5) + 1e-8),
            -1 / (math.sqrt(2) + 1e-8),
            1 / (math.sqrt(2) + 1e-8),
        ]
    )
    for mode in ("reward_sum", "advantage_sum"):
        adv, _ = combine(rewards, {"a": 1.0}, idx([0, 0, 1, 1]), mode=mode, unbiased=True, eps=1e-8)
        torch.testing.assert_close(adv, expected)
