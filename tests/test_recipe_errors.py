"""A corpus of bad recipes: each exits 2 with one line per error naming the key, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from _helpers import run_fgrpo
from fgrpo.core import cli

BAD = Path(__file__).parent / "bad_recipes"

# file -> the error lines expected (substrings, one per reported error, in any order)
EXPECTED = {
    "unknown_component.yaml": [
        "sampler.name: unknown sampler 'ful' (did you mean 'full'?); "
        "available: branch, fast, flash, full, mixgrpo, ode, sparse, tempflow"
    ],
    "wrong_type.yaml": ["train.iterations: expected an integer, got 'many'"],
    "missing_section.yaml": ["objective: missing required section"],
    "unknown_key.yaml": ["sampler.kernel.etta: unknown key (did you mean 'eta'?)"],
    "out_of_range.yaml": ["sampler.kernel.eta: got -0.5; allowed: >= 0"],
    "malformed.yaml": ["malformed.yaml:5:", "malformed YAML"],
    "python_tag.yaml": ["python_tag.yaml:1:", "the YAML tag", "is not allowed"],
    "missing_file.yaml": ["prompts.train: got 'no-such-file.txt'; expected an existing .txt or .jsonl file"],
    "many_errors.yaml": [
        "validation: unknown section",
        "sampler.kernel.eta: got -1.0; allowed: >= 0",
        "objective.clip_range: got 0.0; allowed: > 0",
        "train.group_size: got 1; allowed: >= 2",
    ],
    "not_a_mapping.yaml": ["a recipe is a mapping of sections, got list"],
    "bad_choice.yaml": ["objective.kl_form: got 'forward'; allowed: 'mean', 'flow_grpo', 'velocity'"],
    "missing_name.yaml": ["model.name: missing required key"],
    # issue 9: before, each of these was accepted by `validate` (then a traceback in `compose`),
    # silently changed meaning, or ended in a traceback / a MemoryError
    "alias_bomb.yaml": ["alias_bomb.yaml: YAML aliases (*name) expand it by more than 100000 values"],
    "adam_betas_out_of_range.yaml": ["train.adam_betas: got 2.0 at item 0 of (2.0, 3.0); allowed: >= 0 and < 1"],
    "adam_betas_nan.yaml": ["train.adam_betas: got nan at item 0 of (nan, 0.999); must be a finite number"],
    "kernel_eta_zero.yaml": [
        "sampler.kernel: got {'eta': 0.0, 'name': 'sde'}, which adds no noise at any step (std 0)"
    ],
    "reward_weights.yaml": [
        "reward.0.weight: got nan; must be a finite number",
        "reward.1.weight: got inf; must be a finite number",
        "reward.2.weight: got 1e+308; allowed: >= -1000000.0 and <= 1000000.0",
    ],
    "empty_section.yaml": ["train: expected a mapping of train keys, got an empty section"],
    "duplicate_keys.yaml": [
        "train: duplicate section (",
        "duplicate_keys.yaml:9, first at line 7)",
        "train.lr: duplicate key (",
    ],
    "not_utf8.yaml": ["not_utf8.yaml: not UTF-8 text (byte 0xe9 at offset"],
    # issue 22: tracker options passed `validate`, then `compose` died with a TypeError traceback
    # after writing recipe.resolved.yaml; a 1e8-wide MLP passed it, then an OOM traceback
    "tracker_unknown_option.yaml": [
        "log.init_kwargs.tensorboard.flush_sec: unknown option of the tensorboard tracker (did you mean "
        "'flush_secs'?); allowed: comment, filename_suffix, flush_secs, max_queue",
        "log.init_kwargs.neptune: unknown tracker 'neptune' (accelerate knows: ",
    ],
    "tracker_owned_option.yaml": [
        "log.init_kwargs.tensorboard.logging_dir: fgrpo sets it (TensorBoard writes to RUN/tensorboard); remove it",
        "log.init_kwargs.tensorboard.purge_step: fgrpo sets it (a resumed run hides the events past its checkpoint); "
        "remove it",
    ],
    "tracker_not_listed.yaml": [
        "log.init_kwargs.tensorboard: options for a tracker that log.trackers does not list ([]); they would be "
        "ignored: add it to log.trackers or remove them",
    ],
    "model_too_large.yaml": ["model.hidden: got 100000000; allowed: >= 1 and <= 65536"],
}
# files whose expected parts all belong to one error line
ONE_LINE = ("malformed.yaml", "python_tag.yaml", "duplicate_keys.yaml")


def test_corpus_is_complete():
    assert sorted(p.name for p in BAD.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_recipe_exits_2_naming_the_key(name, capsys):
    code = cli.main(["validate", str(BAD / name)])
    captured = capsys.readouterr()
    assert code == 2
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]
    expected = EXPECTED[name]
    if name == "duplicate_keys.yaml":  # two errors: the section and the key
        assert len(lines) == 2 and all(any(part in line for line in lines) for part in expected), lines
    elif name in ONE_LINE:
        assert len(lines) == 1 and all(part in lines[0] for part in expected), lines
    else:
        assert len(lines) == len(expected), lines
        for part in expected:
            assert any(part in line for line in lines), (part, lines)
    assert "Traceback" not in captured.err + captured.out


def test_yaml_tag_constructs_nothing(tmp_path):
    marker = Path("/tmp/fgrpo-pwned")
    marker.unlink(missing_ok=True)
    assert cli.main(["validate", str(BAD / "python_tag.yaml")]) == 2
    assert not marker.exists()


def test_console_script_reports_without_traceback():
    result = run_fgrpo("validate", str(BAD / "many_errors.yaml"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert sum(ln.startswith("error: ") for ln in result.stderr.splitlines()) == 4
    assert "4 error(s); nothing was run." in result.stderr


def test_compose_refuses_bad_recipe_too(capsys):
    assert cli.main(["compose", str(BAD / "out_of_range.yaml"), "--dry-run"]) == 2


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_compose_of_a_bad_recipe_writes_nothing(name, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["compose", str(BAD / name), "--out", str(out)]) == 2
    assert not out.exists()


@pytest.mark.parametrize("override", ["train=", "train=0", "train=[]", "train=null", "eval=1"])
def test_setting_a_section_to_a_non_mapping_is_an_error(root, override, capsys):
    # before: `--set train=` (and the others) silently replaced the section with its defaults
    assert cli.main(["validate", str(root / "recipes" / "vector.yaml"), "--set", override]) == 2
    section = override.split("=")[0]
    assert f"error: {section}: expected a mapping of {section} keys" in capsys.readouterr().err


def test_an_alias_bomb_in_an_override_is_refused_quickly(root, capsys):
    bomb = '"lol"'
    for level in range(9):  # nine levels of nine, in one --set value
        bomb = "[" + ",".join([f"&a{level} {bomb}"] + [f"*a{level}"] * 8) + "]"
    assert cli.main(["validate", str(root / "recipes" / "vector.yaml"), "--set", f"prompts.train={bomb}"]) == 2
    assert "YAML aliases (*name) expand it by more than" in capsys.readouterr().err


def test_an_alias_that_contains_itself_is_refused(root, capsys):
    assert cli.main(["validate", str(root / "recipes" / "vector.yaml"), "--set", "prompts.train=&a [*a]"]) == 2
    assert "refers to a value that contains it" in capsys.readouterr().err


def test_errors_echo_a_bounded_value(root, capsys):
    long = "[" + ",".join(str(i) for i in range(3000)) + "]"
    assert cli.main(["validate", str(root / "recipes" / "vector.yaml"), "--set", f"train.iterations={long}"]) == 2
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: train.iterations"))
    assert len(line) < 200 and "..." in line


def test_set_overrides_are_typed_and_checked(root, capsys):
    recipe = str(root / "recipes" / "vector.yaml")
    assert cli.main(["validate", recipe, "--set", "train.lr=1e-4", "--set", "sampler.kernel.eta=0.5"]) == 0
    code = cli.main(["validate", recipe, "--set", "train.lr=fast", "--set", "seed", "--set", "train.nope=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "train.lr: expected a number, got 'fast'" in err
    assert "--set: expected KEY=VALUE" in err
    assert "train.nope: unknown key" in err
