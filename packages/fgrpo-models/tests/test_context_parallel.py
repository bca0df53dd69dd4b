"""model.context_parallel: the key validates (bad values one line each, at `fgrpo validate`; ring
attention is refused there, with its reason), and what a launch or a transformer cannot run is
refused when the run is built, one line (the 2- and 4-process runs: tests/test_context_parallel_runs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
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
        (
            {"ulysses_degree": 2, "ring_degree": 2},
            "got ring_degree 2: ring attention (key/value blocks passed round) is not built",
        ),
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
            "context_parallel": {"ulysses_degree": 2},
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


def test_validate_accepts_it_and_one_process_is_refused_with_the_reason(tmp_path, capsys):
    path = recipe(tmp_path, str(tmp_path / "no-pipeline-needed"))  # refused before the pipeline loads
    assert cli.main(["validate", path]) == 0
    assert cli.main(["check", path]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len([line for line in lines if "context_parallel" in line]) == 1
    assert "got ulysses_degree 2 under 1 process(es); the processes must make whole groups of 2" in err


@pytest.mark.parametrize("processes, refused", [(1, True), (2, False), (3, True), (4, False), (6, False)])
def test_the_processes_must_make_whole_groups(processes, refused):
    reason = context_parallel.refusal({"ulysses_degree": 2, "ring_degree": 1}, processes)
    assert (reason is not None) == refused
    if refused:
        assert f"got ulysses_degree 2 under {processes} process(es)" in reason


def test_the_degree_must_divide_the_heads():
    from fgrpo.models.testing import build_tiny_sd3_pipeline

    transformer = build_tiny_sd3_pipeline().transformer  # 4 heads
    with pytest.raises(ValueError, match="got ulysses_degree 3; it must divide the transformer's 4 attention heads"):
        context_parallel.enable([transformer], {"ulysses_degree": 3, "ring_degree": 1})


def test_other_transformers_and_wan_ti2v_are_refused():
    from fgrpo.models.testing import build_tiny_flux_pipeline

    with pytest.raises(ValueError, match="got a FluxTransformer2DModel; allowed: the SD3 and Wan transformers"):
        context_parallel.enable([build_tiny_flux_pipeline().transformer], {"ulysses_degree": 2, "ring_degree": 1})
    ti2v = SimpleNamespace(config={"expand_timesteps": True})
    with pytest.raises(ValueError, match="Wan 2.2 TI2V"):
        context_parallel.enable([], {"ulysses_degree": 2, "ring_degree": 1}, ti2v)


def test_a_sharded_launch_refuses_it():
    from fgrpo.core.config import RecipeError
    from fgrpo.core.launch.common import trainable_module

    policy = SimpleNamespace(context_parallel_size=2, trainable_module=torch.nn.Linear(2, 2))
    optimizer = torch.optim.SGD(policy.trainable_module.parameters(), lr=1.0)
    with pytest.raises(RecipeError, match="runs under a data-parallel launch only"):
        trainable_module(policy, optimizer)


def test_a_processor_fgrpo_does_not_replace_is_refused():
    from diffusers.models.attention_processor import AttnProcessor2_0

    from fgrpo.models.testing import build_tiny_sd3_pipeline

    transformer = build_tiny_sd3_pipeline().transformer
    transformer.transformer_blocks[0].attn.set_processor(AttnProcessor2_0())
    with pytest.raises(ValueError, match="attention uses AttnProcessor2_0; fgrpo splits the sequence for diffusers' "):
        context_parallel.install(transformer, None)  # refused before anything is installed
