from __future__ import annotations

import yaml

from fgrpo.core import recipe as recipe_mod


def test_resolved_recipe_fills_defaults_and_round_trips(root):
    recipe = recipe_mod.load(root / "recipes" / "vector.yaml", ["train.iterations=3"])
    assert recipe.train.iterations == 3
    data = yaml.safe_load(recipe.to_yaml())
    # defaults are written out, so a resolved recipe is complete on its own
    assert data["sampler"]["kernel"]["name"] == "sde"
    assert "max_grad_norm" in data["train"]
    again = recipe_mod.from_text(recipe.to_yaml())
    assert again.data == recipe.data


def test_weighted_reward_list(root):
    text = (root / "recipes" / "vector.yaml").read_text().replace(
        "reward: {name: target-distance}",
        "reward: [{name: target-distance, weight: 0.7}, {name: target-distance, weight: 0.3, label: t2}]",
    )
    recipe = recipe_mod.from_text(text)
    assert [(r.label, r.weight) for r in recipe.rewards] == [("target-distance", 0.7), ("t2", 0.3)]
