"""A corpus of bad recipes: each exits 2 with one line per error naming the key, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from _helpers import run_fgrpo
from fgrpo.core import cli

BAD = Path(__file__).parent / "bad_recipes"

# file -> the error lines expected (substrings, one per reported error, in any order)
EXPECTED = {
    "unknown_component.yaml": ["sampler.name: unknown sampler 'ful' (did you mean 'full'?); available: fast, full, mixgrpo"],
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
    "bad_choice.yaml": ["objective.kl: got 'forward'; allowed: 'mean', 'flow_grpo', 'velocity'"],
    "missing_name.yaml": ["model.name: missing required key"],
}


def test_corpus_is_complete():
    assert sorted(p.name for p in BAD.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_recipe_exits_2_naming_the_key(name, capsys):
    code = cli.main(["validate", str(BAD / name)])
    captured = capsys.readouterr()
    assert code == 2
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]
    expected = EXPECTED[name]
    if name in ("malformed.yaml", "python_tag.yaml"):
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


def test_set_overrides_are_typed_and_checked(root, capsys):
    recipe = str(root / "recipes" / "vector.yaml")
    assert cli.main(["validate", recipe, "--set", "train.lr=1e-4", "--set", "sampler.kernel.eta=0.5"]) == 0
    code = cli.main(["validate", recipe, "--set", "train.lr=fast", "--set", "seed", "--set", "train.nope=1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "train.lr: expected a number, got 'fast'" in err
    assert "--set: expected KEY=VALUE" in err
    assert "train.nope: unknown key" in err
