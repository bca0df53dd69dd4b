"""How a plugin author tests a reward: subclass RewardConformance, then add the reward's own cases."""

from __future__ import annotations

import torch

from fgrpo.core.testing import RewardConformance


class TestBrightness(RewardConformance):
    reward_name = "brightness"  # the name under [project.entry-points."fgrpo.rewards"]

    def make_inputs(self):
        images = torch.linspace(0.1, 0.9, 4).view(4, 1, 1, 1).expand(4, 3, 8, 8).clone()
        return images, ["a", "b", "c", "d"], [{}, {}, {}, {}]

    def test_brighter_scores_higher(self, reward):
        images, prompts, metadata = self.make_inputs()
        scores = reward(images, prompts, metadata).scores
        assert (scores[1:] > scores[:-1]).all()


class TestBrightnessWithTarget(TestBrightness):
    reward_params = {"target": 0.5}

    def test_brighter_scores_higher(self, reward):  # with a target, closest to it wins instead
        images, prompts, metadata = self.make_inputs()
        scores = reward(images, prompts, metadata).scores
        torch.testing.assert_close(scores, -(torch.linspace(0.1, 0.9, 4) - 0.5).abs())
