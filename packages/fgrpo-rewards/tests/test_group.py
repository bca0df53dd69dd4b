"""``pairwise`` (Pref-GRPO's win rates) and ``rank`` (Flow-Factory's PickScore_Rank) on hand-computed
groups, their judge-call counts, and both as conformant group-aware rewards."""

from __future__ import annotations

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.protocols import RewardResult
from fgrpo.core.testing import RewardConformance


class Fixed:
    """A pointwise reward whose score is the output's first coordinate."""

    def __call__(self, outputs, prompts, metadata):
        return RewardResult(scores=outputs[:, 0].float(), details={"first": outputs[:, 0].float()})


def outputs(values):
    return torch.tensor([[float(v), 0.0] for v in values])


def test_win_rates_by_hand():
    # one group, scores [3, 1, 3, 0]: pairs (0,1) 0 wins, (0,2) tie, (0,3) 0, (1,2) 2, (1,3) 1, (2,3) 2
    # wins 0: 1 + 1/2 + 1 = 2.5, 1: 1, 2: 1/2 + 1 + 1 = 2.5, 3: 0; three comparisons each
    reward = registry.create("reward", "pairwise", judge=Fixed())
    result = reward(outputs([3, 1, 3, 0]), ["p"] * 4, [{}] * 4, groups=torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(result.scores, torch.tensor([2.5 / 3, 1 / 3, 2.5 / 3, 0.0]))
    assert result.details["ties"].tolist() == [1, 0, 1, 0]
    assert result.details["judge_calls"].tolist() == [4] * 4  # a pointwise judge scores each sample once
    assert result.details["first"].tolist() == [3, 1, 3, 0]  # the judge's own details pass through


def test_win_rates_are_per_group():
    reward = registry.create("reward", "pairwise", judge=Fixed())
    groups = torch.tensor([0, 0, 1, 1, 1])
    result = reward(outputs([5, 9, 1, 2, 3]), ["a", "a", "b", "b", "b"], [{}] * 5, groups=groups)
    torch.testing.assert_close(result.scores, torch.tensor([0.0, 1.0, 0.0, 0.5, 1.0]))
    assert result.details["judge_calls"].tolist() == [2, 2, 3, 3, 3]


class Comparer:
    """A comparing judge that prefers the larger first coordinate and counts its calls; with
    ``biased`` it always prefers the first image."""

    compares = True

    def __init__(self, biased=False):
        self.pairs, self.biased = [], biased

    def __call__(self, outputs, prompts, metadata):  # a reward component, though it only compares
        raise NotImplementedError

    def compare(self, first, second, prompts, metadata):
        self.pairs += list(zip(first[:, 0].tolist(), second[:, 0].tolist(), strict=True))
        if self.biased:
            return RewardResult(scores=torch.ones(len(first)))
        a, b = first[:, 0], second[:, 0]
        return RewardResult(scores=torch.where(a > b, 1.0, torch.where(a < b, 0.0, 0.5)))


def test_a_comparing_judge_sees_every_pair_once_lower_index_first():
    judge = Comparer()
    reward = registry.create("reward", "pairwise", judge=judge)
    result = reward(outputs([3, 1, 2]), ["p"] * 3, [{}] * 3, groups=torch.zeros(3, dtype=torch.long))
    assert judge.pairs == [(3.0, 1.0), (3.0, 2.0), (1.0, 2.0)]  # itertools.combinations order, as Pref-GRPO
    torch.testing.assert_close(result.scores, torch.tensor([1.0, 0.0, 0.5]))
    assert result.details["judge_calls"].tolist() == [3, 3, 3]  # G (G - 1) / 2 comparisons


def test_both_orders_cancels_a_position_bias_at_twice_the_calls():
    judge = Comparer(biased=True)
    once = registry.create("reward", "pairwise", judge=judge)(
        outputs([3, 1, 2]), ["p"] * 3, [{}] * 3, groups=torch.zeros(3, dtype=torch.long)
    )
    assert once.scores.tolist() == [1.0, 0.5, 0.0]  # the first image always "wins"
    both = registry.create("reward", "pairwise", judge=Comparer(biased=True), both_orders=True)
    result = both(outputs([3, 1, 2]), ["p"] * 3, [{}] * 3, groups=torch.zeros(3, dtype=torch.long))
    assert result.scores.tolist() == [0.5, 0.5, 0.5] and result.details["judge_calls"].tolist() == [6, 6, 6]


def test_rank_by_hand_with_both_tie_rules():
    # scores [3, 1, 3, 0]: stable order 0 (3), 1 (1), 3 (0), 3 (2) -> ranks [2, 1, 3, 0] / 4; average: 2 and 3 -> 2.5
    groups = torch.zeros(4, dtype=torch.long)
    order = registry.create("reward", "rank", reward=Fixed())(
        outputs([3, 1, 3, 0]), ["p"] * 4, [{}] * 4, groups=groups
    )
    torch.testing.assert_close(order.scores, torch.tensor([0.5, 0.25, 0.75, 0.0]))
    average = registry.create("reward", "rank", reward=Fixed(), ties="average")(
        outputs([3, 1, 3, 0]), ["p"] * 4, [{}] * 4, groups=groups
    )
    torch.testing.assert_close(average.scores, torch.tensor([0.625, 0.25, 0.625, 0.0]))
    assert order.details["judge_calls"].tolist() == [4] * 4


def test_a_group_aware_reward_needs_the_groups():
    from fgrpo.core.recipe import RewardSpec
    from fgrpo.core.scoring import RewardError, score

    spec = RewardSpec("pairwise", "pairwise", 1.0, {})
    reward = registry.create("reward", "pairwise", judge=Fixed())
    scores, details = score(
        [(spec, reward)], outputs([1, 2]), ["p", "p"], [{}, {}], where="a test", groups=torch.tensor([0, 0])
    )
    assert scores["pairwise"].tolist() == [0.0, 1.0]
    with pytest.raises(RewardError, match="judges whole prompt groups"):
        score([(spec, reward)], outputs([1, 2]), ["p", "p"], [{}, {}], where="a test")


def vectors():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 2, generator=g)


class TestPairwiseOverAPointwiseReward(RewardConformance):
    reward_name = "pairwise"
    reward_params = {"judge": {"name": "target-distance"}}

    def make_inputs(self):
        prompts = ["target 0 0"] * 3 + ["target 1 1"] * 3
        return vectors(), prompts, [{} for _ in prompts]


class TestRankOverAPointwiseReward(RewardConformance):
    reward_name = "rank"
    reward_params = {"reward": {"name": "target-distance"}, "ties": "average"}

    def make_inputs(self):
        prompts = ["target 0 0"] * 3 + ["target 1 1"] * 3
        return vectors(), prompts, [{} for _ in prompts]
