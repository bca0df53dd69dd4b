"""Recipe keys mean one thing across objectives (docs/method.md, "One name per meaning"): the old
names still validate, as the new key, with one line that names it."""

from __future__ import annotations

import warnings

import pytest

from fgrpo.core import cli
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.config import DeprecatedKey, RecipeError

OLD_NAMES = [
    ("grpo", {"beta": 0.05, "kl": "velocity"}, {"kl_beta": 0.05, "kl_form": "velocity"}),
    ("grpo-guard", {"beta": 0.02, "kl": "mean"}, {"kl_beta": 0.02, "kl_form": "mean"}),
    (
        "awm",
        {"beta": 0.3, "kl_weight": "ELBO", "ema_beta": 0.5, "kl_ema_weight": "ELBO"},
        {"kl_beta": 0.3, "kl_form": "ELBO", "ema_kl_beta": 0.5, "ema_kl_form": "ELBO"},
    ),
    ("nft", {"beta": 0.1}, {"nft_beta": 0.1}),
    ("dpo", {"beta": 7.0}, {"dpo_beta": 7.0}),
]
#: the sampler each kind of objective trains with
SAMPLERS = {
    "grpo": "sampler={name: full, steps: 4, kernel: {name: sde, eta: 0.7}}",
    "grpo-guard": "sampler={name: full, steps: 4, kernel: {name: sde, eta: 0.7}}",
    "awm": "sampler={name: ode, steps: 4}",
    "nft": "sampler={name: ode, steps: 4}",
    "dpo": "sampler={name: ode, steps: 4}",
}


def _flow(mapping: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"


@pytest.mark.parametrize("name, old, new", OLD_NAMES)
def test_an_old_key_validates_as_the_new_one_with_a_note(root, name, old, new):
    overrides = [f"objective={_flow({'name': name, **old})}", SAMPLERS[name]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = recipe_mod.load(root / "recipes" / "vector.yaml", overrides)
    resolved = recipe.data["objective"]
    assert {k: resolved[k] for k in new} == new
    assert not set(old) & set(resolved)
    notes = sorted(str(w.message) for w in caught if issubclass(w.category, DeprecatedKey))
    assert notes == sorted(
        f"objective.{o} is deprecated: it is now objective.{n} (the value is used)"
        for o, n in zip(old, new, strict=True)
    )


def test_the_cli_prints_one_note_line_per_old_key(root, capsys):
    code = cli.main(["validate", str(root / "recipes" / "vector.yaml"), "--set", "objective.beta=0.1"])
    captured = capsys.readouterr()
    assert code == 0 and "vector.yaml: ok" in captured.out
    assert captured.err.splitlines() == [
        "note: objective.beta is deprecated: it is now objective.kl_beta (the value is used)"
    ]


def test_a_key_under_both_names_is_an_error(root):
    with pytest.raises(RecipeError) as info:
        recipe_mod.load(root / "recipes" / "vector.yaml", ["objective.beta=0.1", "objective.kl_beta=0.2"])
    assert [str(e) for e in info.value.errors] == [
        "objective.beta: the old name of objective.kl_beta, which is given too: keep kl_beta"
    ]


def test_the_shipped_recipes_use_the_new_names(root):
    """No shipped recipe validates with a note: they are written with the new names (a note is
    raised here; other errors, such as a real recipe's absent dataset folder, do not matter)."""
    paths = sorted((root / "recipes").rglob("*.yaml"))
    assert len(paths) > 40
    for path in paths:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecatedKey)
            try:
                recipe_mod.load(path)
            except RecipeError:
                pass


def test_the_kernel_ode_is_the_kernel_euler_with_a_note(root):
    """``ode`` named both a kernel (the Euler step) and a sampler (deterministic rollouts); the
    kernel is ``euler`` now, and a recipe with the old name still validates, resolved to it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = recipe_mod.load(
            root / "recipes" / "vector.yaml", ["sampler={name: ode, steps: 4, kernel: ode}", "objective={name: awm}"]
        )
    assert recipe.data["sampler"]["kernel"]["name"] == "euler"
    notes = [str(w.message) for w in caught if issubclass(w.category, DeprecatedKey)]
    assert notes == ["sampler.kernel.name: the kernel 'ode' is deprecated: it is now 'euler'"]
