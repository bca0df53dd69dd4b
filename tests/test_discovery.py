"""The newcomer's first questions each have a command: which recipes ship (``fgrpo recipes``),
which keys a section takes (``fgrpo keys``), a recipe to start from (``fgrpo init``), and a
"did you mean" for a key another toolkit names otherwise."""

from __future__ import annotations

import json

import pytest

from fgrpo.core import cli, discovery, recipe
from fgrpo.core.config import RecipeError
from fgrpo.core.recipe import TrainConfig
from fgrpo.core.shipped import recipe_names, recipes_folder

#: the recipes that train on this machine's CPUs, and so carry what they measured here
CPU_RECIPES = {
    "shapes",
    "shapes-fast",
    "shapes-mixgrpo",
    "shapes-guard",
    "shapes-awm",
    "shapes-nft",
    "shapes-dpo",
    "shapes-edit",
    "shapes-pairwise",
    "driving",
    "driving-nft",
    "driving-naive",
    "vector",
}


def _json_of(capsys, *args: str) -> object:
    assert cli.main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_recipes_lists_every_shipped_recipe_with_its_components_and_what_it_shows(capsys):
    rows = _json_of(capsys, "recipes", "--json")
    assert [r["name"] for r in rows] == recipe_names()
    by_name = {r["name"]: r for r in rows}
    shapes = by_name["shapes"]
    assert (shapes["model"], shapes["objective"], shapes["sampler"]) == ("shapes-dit", "grpo", "full")
    assert all(r["shows"] != "(no header)" and len(r["shows"]) <= 110 for r in rows), [
        r["name"] for r in rows if r["shows"] == "(no header)"
    ]


@pytest.mark.parametrize("name", sorted(CPU_RECIPES))
def test_a_recipe_that_trains_on_cpus_states_what_it_measured(capsys, name):
    rows = {r["name"]: r for r in _json_of(capsys, "recipes", "--json")}
    measured = rows[name]["measured"]
    assert not measured.startswith("not measured"), f"{name}.yaml has no '# measured:' header line"
    assert any(ch.isdigit() for ch in measured) and "->" in measured, measured


@pytest.mark.parametrize("name", sorted(CPU_RECIPES))
def test_a_cpu_recipe_states_its_time_with_the_conditions_and_the_one_thread_figure(name):
    text = (recipes_folder() / f"{name}.yaml").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("# time:")), None)
    assert line is not None, f"{name}.yaml has no '# time:' header line"
    assert "2 idle threads" in line and "1 thread" in line, line
    assert any(r["time"] == line[len("# time:") :].strip() for r in discovery.recipe_rows() if r["name"] == name)


def test_recipes_prints_one_block_per_recipe(capsys):
    assert cli.main(["recipes"]) == 0
    text = capsys.readouterr().out
    for name in recipe_names():
        assert f"\n{name}: " in "\n" + text
    assert f"{len(recipe_names())} recipes" in text


def test_keys_of_train_give_type_default_bounds_and_help(capsys):
    assert cli.main(["keys", "train"]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("train.lr:"))
    assert "a number" in line and f"default {TrainConfig().lr!r}" in line and "> 0" in line, line
    assert "train.group_size:" in text and ">= 2" in text
    for field in ("iterations", "checkpoint_every", "mixed_precision"):
        assert f"train.{field}:" in text
    # every key has its help line under it
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if ln.startswith("  train."):
            assert lines[i + 1].startswith("      ") and lines[i + 1].strip(), ln


def test_keys_of_eval_log_and_a_component(capsys):
    for section, key in (("eval", "every"), ("log", "timeout_s"), ("objective.grpo", "clip_range")):
        assert cli.main(["keys", section]) == 0
        text = capsys.readouterr().out
        assert f".{key}:" in text, (section, text[:400])
    assert cli.main(["keys", "objective"]) == 0
    text = capsys.readouterr().out
    assert "objective.grpo:" in text and "objective.nft:" in text


def test_keys_without_a_section_lists_the_sections_and_kinds(capsys):
    assert cli.main(["keys"]) == 0
    text = capsys.readouterr().out
    assert "recipe sections: " in text and "train" in text.splitlines()[0]
    assert any(ln.startswith("objective: ") and "grpo" in ln for ln in text.splitlines())


def test_keys_of_an_unknown_section_is_one_line_with_a_suggestion(capsys):
    assert cli.main(["keys", "trian"]) == 2
    captured = capsys.readouterr()
    assert "did you mean 'train'" in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("world", ["shapes", "shapes-edit", "driving", "vector"])
def test_init_for_a_world_writes_a_recipe_that_validates(tmp_path, capsys, world):
    target = tmp_path / f"{world}.yaml"
    assert cli.main(["init", "--world", world, "--out", str(target)]) == 0
    text = target.read_text()
    assert text.startswith(f"# Started from the shipped {world}.yaml")
    assert cli.main(["validate", str(target)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("model", ["sd3", "flux"])
def test_init_for_a_model_writes_a_commented_recipe_that_validates(tmp_path, capsys, model):
    target = tmp_path / "mine.yaml"
    assert cli.main(["init", "--model", model, "--out", str(target)]) == 0
    text = target.read_text()
    assert f"name: {model}" in text and "# " in text and "fgrpo keys" in text
    # the train block shows the trainer's own defaults, not numbers typed into a template
    assert f"lr: {TrainConfig().lr}" in text
    assert cli.main(["validate", str(target)]) == 0, capsys.readouterr().err


def test_init_refuses_an_existing_file_and_an_unknown_world(tmp_path, capsys):
    target = tmp_path / "kept.yaml"
    target.write_text("mine\n")
    assert cli.main(["init", "--world", "shapes", "--out", str(target)]) == 2
    assert target.read_text() == "mine\n"
    assert cli.main(["init", "--world", "shapse"]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "did you mean 'shapes'" in err
    assert cli.main(["init"]) == 2


@pytest.mark.parametrize(
    ("key", "suggested"),
    [
        ("train.learning_rate", "lr"),
        ("train.max_steps", "iterations"),
        ("train.num_generations", "group_size"),
        ("objective.kl_coef", "kl_beta"),
        ("sampler.num_inference_steps", "steps"),
    ],
)
def test_a_synonym_from_another_toolkit_suggests_fgrpo_s_name(key, suggested):
    with pytest.raises(RecipeError) as caught:
        recipe.load("shapes", [f"{key}=1"])
    message = str(caught.value)
    assert f"did you mean {suggested!r}" in message, message


def test_recipe_load_takes_a_shipped_name_as_the_cli_does():
    by_name = recipe.load("shapes")
    by_path = recipe.load(recipes_folder() / "shapes.yaml")
    assert by_name.data == by_path.data
    with pytest.raises(RecipeError, match="did you mean 'shapes'"):
        recipe.load("shapse")
