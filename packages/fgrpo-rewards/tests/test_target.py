"""target-distance, and the prompt -> target convention it shares with the vector policy."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.testing import RewardConformance
from fgrpo.core.vectors import condition_vector, hashed_vector, target_numbers, target_vector

PROMPTS = ["target 0.5 -1.0", "target 1 1", "a cat", "go to target: (0, 0.25)"]


class TestTargetDistance(RewardConformance):
    reward_name = "target-distance"

    def make_inputs(self):
        outputs = torch.tensor([[0.5, -1.0], [0.0, 1.0], [0.3, 0.3], [2.0, 2.0]])
        return outputs, list(PROMPTS), [{} for _ in PROMPTS]


class TestTargetDistanceGaussian(TestTargetDistance):
    reward_params = {"form": "gaussian", "temperature": 0.5}


def test_scores_by_hand():
    reward = registry.create("reward", "target-distance")
    outputs = torch.tensor([[0.5, -1.0], [0.0, 1.0], [3.0, 4.0]])
    result = reward(outputs, ["target 0.5 -1.0", "target 1 1", "target 0 0"], [{}, {}, {}])
    torch.testing.assert_close(result.scores, torch.tensor([0.0, -1.0, -5.0]))
    torch.testing.assert_close(result.details["distance"], torch.tensor([0.0, 1.0, 5.0]))
    gaussian = registry.create("reward", "target-distance", form="gaussian", temperature=2.0)
    scores = gaussian(outputs, ["target 0.5 -1.0", "target 1 1", "target 0 0"], [{}, {}, {}]).scores
    torch.testing.assert_close(scores, torch.tensor([1.0, math.exp(-0.5), math.exp(-12.5)]))


def test_metadata_target_overrides_the_prompt():
    reward = registry.create("reward", "target-distance")
    result = reward(torch.tensor([[1.0, 2.0]]), ["target 0 0"], [{"target": [1, 2]}])
    assert result.scores.item() == 0.0


def test_trajectory_outputs_are_flattened():
    reward = registry.create("reward", "target-distance")
    out = torch.tensor([[[0.0, 1.0], [2.0, 3.0]]])  # (B, T, 2)
    assert reward(out, ["target 0 1 2 3"], [{}]).scores.item() == 0.0


def test_wrong_number_of_target_numbers_is_a_clear_error():
    reward = registry.create("reward", "target-distance")
    with pytest.raises(ValueError, match="target of 3 numbers; the outputs have 2 dimensions"):
        reward(torch.zeros(1, 2), ["target 1 2 3"], [{}])
    with pytest.raises(ValueError, match="3 numbers; the outputs have 2"):
        reward(torch.zeros(1, 2), ["x"], [{"target": [1, 2, 3]}])


@pytest.mark.parametrize(
    ("prompt", "numbers"),
    [
        ("target 0.5 -1.0", [0.5, -1.0]),
        ("go to target: (0.5, -1)", [0.5, -1.0]),
        ("TARGET=[1e-1,2]", [0.1, 2.0]),
        ("target .5 +2", [0.5, 2.0]),
        ("a 2d cat", None),
        ("targets 1 2", None),
    ],
)
def test_target_numbers(prompt, numbers):
    assert target_numbers(prompt) == numbers


def test_hashed_targets_are_fixed_and_bounded():
    a = target_vector("a cat", 3)
    torch.testing.assert_close(a, target_vector("a cat", 3))
    assert not torch.allclose(a, target_vector("a dog", 3))
    assert (a.abs() <= 1).all() and a.dtype == torch.float32
    # pinned values: the convention must not drift between releases or machines
    torch.testing.assert_close(hashed_vector("a cat", 2, salt="target:"), target_vector("a cat", 2))
    values = hashed_vector("x", 4)
    assert values.shape == (4,) and (values.abs() <= 1).all()


def test_condition_vector_starts_with_the_target():
    c = condition_vector("target 1 2", 2, 5)
    assert c.shape == (5,)
    torch.testing.assert_close(c[:2], torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(condition_vector("target 1 2", 2, 1), torch.tensor([1.0]))
    assert condition_vector("target 1 2", 2, 0).shape == (0,)
