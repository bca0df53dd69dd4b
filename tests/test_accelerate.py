"""accelerate's mixed precision and gradient accumulation are honoured (or refused with a message),
whether they come from `accelerate launch` flags, its config file or the recipe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from _helpers import free_port
from fgrpo.core import cli
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.building import build_run
from fgrpo.core.config import RecipeError
from fgrpo.core.launch import accelerate_settings
from fgrpo.core.trainer import iteration

QUIET = Console(quiet=True)
BIN = Path(sys.executable).parent


def vector(root, *overrides):
    return recipe_mod.load(root / "recipes" / "vector.yaml", list(overrides))


def test_autocast_dtype_inside_the_model_under_accelerate_bf16(root, monkeypatch):
    """What `accelerate launch --mixed_precision bf16` passes on (ACCELERATE_MIXED_PRECISION):
    every forward of the rollout and of the update runs under bf16 autocast, and the run stays
    on-policy (the first ratio is exactly 1)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    run = build_run(vector(root, "train.minibatch_size=0"), out_dir=None, console=QUIET, quiet=True)
    assert run.accelerator.mixed_precision == "bf16"
    seen = []
    run.learner.policy.net.register_forward_pre_hook(
        lambda module, args: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
    )
    metrics = iteration(run, 0)
    steps = run.recipe.data["sampler"]["steps"]
    assert len(seen) > steps  # the rollout's forwards and the update's
    assert set(seen) == {(True, torch.bfloat16)}
    assert metrics["first_ratio_deviation"] == 0.0
    assert all(p.dtype == torch.float32 for p in run.learner.trainable)  # weights stay float32 (autocast, not a cast)


def test_check_passes_under_accelerate_launch_bf16(root, tmp_path):
    done = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--cpu",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "bf16",
            "--dynamo_backend",
            "no",
            "-m",
            "fgrpo.core.cli",
            "check",
            str(root / "recipes" / "vector.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mixed precision bf16" in done.stdout and "on-policy check passed" in done.stdout


def test_recipe_and_launcher_settings():
    class Train:
        mixed_precision = "auto"
        gradient_accumulation_steps = 0

    assert accelerate_settings(Train(), {}) == ("no", 1)
    launched = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}
    assert accelerate_settings(Train(), launched) == ("bf16", 4)
    Train.mixed_precision, Train.gradient_accumulation_steps = "bf16", 2
    assert accelerate_settings(Train(), {"ACCELERATE_MIXED_PRECISION": "no"}) == ("bf16", 2)  # the launcher's default
    with pytest.raises(RecipeError) as info:
        accelerate_settings(
            Train(), {"ACCELERATE_MIXED_PRECISION": "fp16", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "3"}
        )
    assert [e.key for e in info.value.errors] == ["train.mixed_precision", "train.gradient_accumulation_steps"]
    assert "'bf16' but accelerate was launched with mixed precision 'fp16'" in str(info.value)


def test_fp16_on_the_cpu_is_refused(root, capsys):
    assert cli.main(["check", str(root / "recipes" / "vector.yaml"), "--set", "train.mixed_precision=fp16"]) == 2
    assert "fp16 mixed precision needs a GPU" in capsys.readouterr().err


def test_gradient_accumulation_from_accelerate(root, monkeypatch):
    """ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2 (what `--gradient_accumulation_steps 2` passes on):
    one optimizer step per 2 minibatches, the same update as minibatches twice the size."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    accumulated = build_run(
        vector(root, "train.minibatch_size=16", "train.shuffle_minibatches=false"),
        out_dir=None,
        console=QUIET,
        quiet=True,
    )
    assert accumulated.accelerator.gradient_accumulation_steps == 2
    assert iteration(accumulated, 0)["optimizer_steps"] == 2  # 64 samples, 4 minibatches
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    larger = build_run(
        vector(root, "train.minibatch_size=32", "train.shuffle_minibatches=false"),
        out_dir=None,
        console=QUIET,
        quiet=True,
    )
    assert iteration(larger, 0)["optimizer_steps"] == 2
    for a, b in zip(accumulated.learner.trainable, larger.learner.trainable, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "accelerate"


#: the shipped DeepSpeed configs: (ZeRO stage, offload_optimizer_device, offload_param_device)
DEEPSPEED_CONFIGS = {
    "deepspeed-zero2.yaml": (2, "none", "none"),
    "deepspeed-zero2-offload.yaml": (2, "cpu", "none"),
    "deepspeed-zero3.yaml": (3, "none", "none"),
    "deepspeed-zero3-offload.yaml": (3, "cpu", "cpu"),
}


@pytest.mark.parametrize(
    "name", ["ddp.yaml", "cpu.yaml", "multi-node.yaml", "fsdp-lora.yaml", "fsdp-full.yaml", *DEEPSPEED_CONFIGS]
)
def test_shipped_accelerate_configs_are_valid(name):
    """Each config reads with accelerate's own loader, is a kind fgrpo runs (data parallel, FSDP2
    sharding one unit per transformer block, DeepSpeed ZeRO-2 or ZeRO-3, with or without CPU
    offloading, never zero3_init) and is documented with its launch command."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    config = load_config_from_file(str(CONFIGS / name))
    assert isinstance(config, ClusterConfig)
    kind = str(config.distributed_type).split(".")[-1]
    if name.startswith("fsdp"):
        assert kind == "FSDP"
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert (
            not config.fsdp_config["fsdp_offload_params"] and not config.fsdp_config["fsdp_activation_checkpointing"]
        )
    elif name.startswith("deepspeed"):
        assert kind == "DEEPSPEED"
        ds = config.deepspeed_config
        assert (ds["zero_stage"], ds["offload_optimizer_device"], ds["offload_param_device"]) == DEEPSPEED_CONFIGS[
            name
        ]
        assert ds["zero3_init_flag"] is False  # fgrpo loads the models whole (refused when true)
        assert "gradient_clipping" not in config.deepspeed_config  # fgrpo passes train.max_grad_norm
    else:
        assert kind == "MULTI_GPU"  # data parallel
        if name == "multi-node.yaml":
            assert (
                config.num_machines == 2
                and config.rdzv_backend == "static"
                and "SLURM" in (CONFIGS / name).read_text()
            )
    assert config.num_processes >= 2 and config.mixed_precision in ("no", "bf16")
    text = (CONFIGS / name).read_text()
    assert f"accelerate launch --config_file recipes/accelerate/{name}" in text
    assert f"`{name}`" in (CONFIGS / "README.md").read_text()
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == [
        "cpu.yaml",
        "ddp.yaml",
        *sorted(DEEPSPEED_CONFIGS),
        "fsdp-full.yaml",
        "fsdp-lora.yaml",
        "multi-node.yaml",
    ]


@pytest.mark.slow
def test_cpu_config_runs_two_processes(root, tmp_path):
    """The shipped CPU config starts two data-parallel processes (about 45 s on 2 busy cores)."""
    done = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(CONFIGS / "cpu.yaml"),
            "--main_process_port",
            str(free_port()),
            "-m",
            "fgrpo.core.cli",
            "compose",
            str(root / "recipes" / "vector.yaml"),
            "--out",
            str(tmp_path / "run"),
            "--quiet",
            "--set",
            "train.iterations=2",
            "--set",
            "eval.every=0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(2 process(es)" in done.stdout
