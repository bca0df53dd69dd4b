"""model.context_parallel: the key validates (bad values one line each, at `fgrpo validate`), and
a run that asks for it is refused when built, with the reason for the machine (no GPUs: diffusers
cannot set it up; GPUs: fgrpo's group-to-process mapping is not built), exit 2, no traceback."""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip("diffusers")

from fgrpo.core import cli
from fgrpo.core.config import check_params
from fgrpo.models import context_parallel
from fgrpo.models.flux import FluxPolicy
from fgrpo.models.sd3 import SD3Policy
from fgrpo.models.wan import WanPolicy


@pytest.mark.parametrize("policy", [SD3Policy, FluxPolicy, WanPolicy])
def test_every_diffusers_backbone_takes_the_key(policy):
    checked, errors = check_params(policy, {"path": "x", "context_parallel": {"ulysses_degree": 2}}, "model")
    assert not errors and checked["context_parallel"] == {"ulysses_degree": 2, "ring_degree": 1}
    assert check_params(policy, {"path": "x"}, "model")[0]["context_parallel"] is None


@pytest.mark.parametrize(
    "value, message",
    [
        ({"ulysses": 2}, "got unknown key(s) 'ulysses'; allowed keys: ulysses_degree, ring_degree"),
        ({"ulysses_degree": 0}, "got ulysses_degree 0; allowed: a positive integer"),
        ({"ring_degree": 1.5}, "got ring_degree 1.5; allowed: a positive integer"),
        ({"ulysses_degree": True}, "got ulysses_degree True; allowed: a positive integer"),
        ({"ulysses_degree": 1, "ring_degree": 1}, "one process per sample is no context parallelism"),
        (4, "expected a mapping or null, got 4"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(value, message):
    _, errors = check_params(SD3Policy, {"path": "x", "context_parallel": value}, "model")
    assert [e.key for e in errors] == ["model.context_parallel"] and message in errors[0].message


def recipe(tmp_path, pipeline_path: str) -> str:
    data = {
        "model": {
            "name": "sd3",
            "path": pipeline_path,
            "device": "cpu",
            "context_parallel": {"ulysses_degree": 2, "ring_degree": 2},
        },
        "sampler": {"name": "full", "steps": 2},
        "reward": "jpeg-compressibility",
        "objective": "grpo",
        "prompts": {"name": "list", "train": ["a cat", "a dog"], "test": ["a cat"]},
        "train": {"iterations": 1, "group_size": 2, "prompts_per_iteration": 1},
    }
    path = tmp_path / "cp.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_validate_accepts_it_and_a_cpu_run_is_refused_with_the_reason(tmp_path, capsys):
    path = recipe(tmp_path, str(tmp_path / "no-pipeline-needed"))  # refused before the pipeline loads
    assert cli.main(["validate", path]) == 0
    assert cli.main(["check", path]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len([line for line in lines if "context_parallel" in line]) == 1
    assert "model.context_parallel (4 processes per sample) needs GPUs" in err
    assert "ZeroDivisionError in diffusers 0.42.1 modeling_utils.py:1719" in err
    assert "set model.context_parallel: null on a CPU" in err


def test_on_gpus_the_missing_mapping_is_the_reason():
    reason = context_parallel.refusal({"ulysses_degree": 2, "ring_degree": 1}, accelerators=8)
    assert reason.startswith("model.context_parallel (2 processes per sample) is not supported yet")
    assert "same prompts, noise and rewards" in reason
