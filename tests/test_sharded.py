"""Sharded runs (FSDP2 through accelerate's FSDP plugin) on 2 CPU processes over gloo, on a tiny
SD3 pipeline: the same run as data parallel, resumed exactly, checkpoints, EMA and the diffusers
export written from sharded weights; the shipped launch with bf16 stays on-policy; what cannot be
sharded is refused with a message."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.core import sharding
from fgrpo.core.config import RecipeError

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
CONFIGS = HERE.parent / "recipes" / "accelerate"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory) -> str:
    from fgrpo.models.testing import build_tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny-sd3")
    build_tiny_sd3_pipeline(path, sd35=True)
    return str(path)


def sd3_recipe(folder: Path, pipeline: str, *, lora: bool) -> Path:
    """Two prompts per iteration (one per process), CFG, KL to the base with LoRA, an EMA, an
    evaluation at the start and every 2 iterations, a checkpoint every iteration."""
    data = {
        "seed": 0,
        "model": {"name": "sd3", "path": pipeline, "device": "cpu", "max_sequence_length": 16, "lora": {"rank": 4} if lora else None},
        "sampler": {"name": "full", "steps": 2, "kernel": {"name": "sde", "eta": 0.7}},
        "reward": {"name": "target-distance"},  # continuous in the pixels: tiny weight differences stay tiny
        "objective": {"name": "grpo", "clip_range": 1e-3, "beta": 0.01 if lora else 0.0},
        "prompts": {"name": "list", "train": ["a red circle", "two blue squares", "a green triangle", "one yellow star"],
                    "test": ["a red square", "a blue circle"]},
        "train": {"iterations": 3, "group_size": 2, "prompts_per_iteration": 2, "micro_batch_size": 1,
                  "lr": 1e-2 if lora else 1e-3, "adam_eps": 1e-6, "drop_zero_advantage": False, "checkpoint_every": 1, "ema_decay": 0.9},
        "eval": {"every": 2, "samples_per_prompt": 1, "steps": 2},
        "log": {"plots": False, "quiet": True, "sample_grid": False},
    }
    path = folder / ("sd3-lora.yaml" if lora else "sd3-full.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timing(table: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(("time_", "samples_per_s"))} for row in table]


def last(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last"


def optimizer_tensors(run_dir: Path) -> dict:
    state = torch.load(last(run_dir) / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    return {(i, k): v for i, per_param in state.items() for k, v in per_param.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["lora", pytest.param("full", marks=pytest.mark.slow)])
def test_sharded_run_equals_data_parallel_and_resumes_exactly(variant, tiny_sd3, tmp_path):
    recipe = sd3_recipe(tmp_path, tiny_sd3, lora=variant == "lora")
    launcher = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    done = subprocess.run(
        [*launcher, str(HERE / "fsdp_worker.py"), str(recipe), str(tmp_path / "runs"), "3"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, timeout=600, capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    runs = tmp_path / "runs"
    report = [json.loads((runs / f"report-rank{r}.json").read_text()) for r in (0, 1)]
    ddp, fsdp = report[0]["ddp"], report[0]["fsdp"]
    assert not ddp["sharded"] and not ddp["dtensor"]
    # sharded for real: DTensor parameters, each process holding half of a tensor
    assert fsdp["sharded"] and fsdp["dtensor"] and fsdp["local_numel"] * 2 == fsdp["numel"]
    assert report[0]["resumed"]["start"] == 2
    # process 1 trains on fewer samples: it pads with passes that change nothing, process 0 never
    assert report[1]["fsdp"]["padding_passes"] > 0 and report[0]["fsdp"]["padding_passes"] == 0
    assert report[1]["ddp"]["padding_passes"] == 0

    # on-policy under FSDP as under data parallel: the first ratio of every iteration is 1 (within
    # fgrpo check's 1e-6: one pair per forward here, the rollout's forwards held two samples)
    for name in ("ddp", "fsdp", "resumed"):
        deviations = [r["first_ratio_deviation"] for r in rows(runs / name) if "first_ratio_deviation" in r]
        assert len(deviations) == 3 and max(deviations) <= 1e-6, (name, deviations)
    # the same run: weights, EMA, optimizer moments and metrics within float tolerance
    files = ["trainable.safetensors", "ema.safetensors"] + (["export/pytorch_lora_weights.safetensors"] if variant == "lora" else [])
    for name in files:
        a, b = load_file(str(last(runs / "ddp") / name)), load_file(str(last(runs / "fsdp") / name))
        assert a.keys() == b.keys() and a, name
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")
    a, b = optimizer_tensors(runs / "ddp"), optimizer_tensors(runs / "fsdp")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
    for x, y in zip(rows(runs / "ddp"), rows(runs / "fsdp")):
        assert x.keys() == y.keys()
        for key, value in x.items():
            if isinstance(value, float) and not key.startswith(("time_", "samples_per_s")):
                assert y[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # resumed under FSDP from a checkpoint of sharded weights: bit for bit the uninterrupted run
    for name in files + ["optimizer.pt"]:
        if name.endswith(".safetensors"):
            a, b = load_file(str(last(runs / "fsdp") / name)), load_file(str(last(runs / "resumed") / name))
            assert all(torch.equal(a[k], b[k]) for k in a), name
    a, b = optimizer_tensors(runs / "fsdp"), optimizer_tensors(runs / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert without_timing(rows(runs / "fsdp")) == without_timing(rows(runs / "resumed"))
    # the checkpoint of a sharded run reads back as any other: diffusers loads its LoRA export
    if variant == "lora":
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
        pipe.load_lora_weights(str(last(runs / "fsdp") / "export"))
        assert any("lora" in name for name, _ in pipe.transformer.named_parameters())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_shipped_fsdp_config_launches_and_stays_on_policy_under_bf16(tiny_sd3, tmp_path):
    """`accelerate launch --config_file recipes/accelerate/fsdp-lora.yaml` (bf16) on a machine
    without GPUs: two sharded processes over gloo, first ratio exactly 1 (about 25 s)."""
    recipe = sd3_recipe(tmp_path, tiny_sd3, lora=True)
    done = subprocess.run(
        [str(BIN / "accelerate"), "launch", "--config_file", str(CONFIGS / "fsdp-lora.yaml"), "--num_processes", "2",
         "--main_process_port", str(free_port()), "-m", "fgrpo.core.cli", "check", str(recipe), "--set", "train.micro_batch_size=0"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("on-policy check passed") == 2
    assert "2 process(es), sharded (FSDP2)" in done.stdout and "mixed precision bf16" in done.stdout
    assert "largest |ratio - 1| before the first optimizer step: 0.000e+00" in done.stdout


# --- what cannot be sharded is refused ---------------------------------------------------------


def fsdp_accelerator(version: int = 2) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version, mixed_precision_policy=None)))


def test_a_policy_without_trainable_module_is_refused():
    from fgrpo.core.testing import GaussianPolicy

    policy = GaussianPolicy()
    optimizer = torch.optim.AdamW(list(policy.trainable_parameters()))
    with pytest.raises(RecipeError, match="cannot be sharded: it names no trainable_module"):
        sharding.shard_policy(fsdp_accelerator(), policy, optimizer)


def test_fsdp_version_1_is_refused():
    module = torch.nn.Linear(2, 2)
    policy = SimpleNamespace(trainable_module=module, trainable_parameters=module.parameters)
    with pytest.raises(RecipeError, match="fsdp_version 1 is not supported") as info:
        sharding.shard_policy(fsdp_accelerator(1), policy, torch.optim.AdamW(module.parameters()))
    assert info.value.errors[0].key == "accelerate"


def test_trainable_parameters_outside_the_module_are_refused():
    module, extra = torch.nn.Linear(2, 2), torch.nn.Parameter(torch.zeros(2))
    policy = SimpleNamespace(trainable_module=module)
    with pytest.raises(RecipeError, match="outside its trainable_module"):
        sharding.shard_policy(fsdp_accelerator(), policy, torch.optim.AdamW([*module.parameters(), extra]))


def test_whole_optimizer_state_of_an_unsharded_run_is_its_state_dict():
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.full((3,), 0.5)
    optimizer.step()
    saved = sharding.full_optimizer_state(optimizer)
    torch.testing.assert_close(saved["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"], rtol=0, atol=0)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    sharding.load_full_optimizer_state(other, saved)
    assert torch.equal(other.state_dict()["state"][0]["exp_avg_sq"], saved["state"][0]["exp_avg_sq"])
