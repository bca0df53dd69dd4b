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
    text = (
        (root / "recipes" / "vector.yaml")
        .read_text()
        .replace(
            "reward: {name: target-distance}",
            "reward: [{name: target-distance, weight: 0.7}, {name: target-distance, weight: 0.3, label: t2}]",
        )
    )
    recipe = recipe_mod.from_text(text)
    assert [(r.label, r.weight) for r in recipe.rewards] == [("target-distance", 0.7), ("t2", 0.3)]


def test_a_bare_no_is_the_word_no_where_a_choice_allows_it(root):
    """YAML 1.1 reads `mixed_precision: no` (and --set ...=no) as false; where the key's choices
    include the word, it means the word; elsewhere a boolean is still refused."""
    recipe = recipe_mod.load(root / "recipes" / "vector.yaml", ["train.mixed_precision=no"])
    assert recipe.train.mixed_precision == "no"
    text = (root / "recipes" / "vector.yaml").read_text()
    assert (
        recipe_mod.from_text(text.replace("train: {", "train: {mixed_precision: no, ")).train.mixed_precision == "no"
    )
    try:
        recipe_mod.load(root / "recipes" / "vector.yaml", ["train.lr_schedule=no"])
    except recipe_mod.RecipeError as exc:
        assert "lr_schedule" in str(exc) and "False" in str(exc)
    else:
        raise AssertionError("a boolean where no choice is a yes/no word must be refused")
