"""Sharded runs (FSDP2 through accelerate's FSDP plugin) on 2 CPU processes over gloo, on a tiny
SD3 pipeline: the same run as data parallel, resumed exactly, checkpoints, EMA and the diffusers
export written from sharded weights; the shipped launch with bf16 stays on-policy; what cannot be
sharded is refused with a message."""

from __future__ import annotations

import json
import os
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

from _helpers import free_port, torchrun
from fgrpo.core.config import RecipeError
from fgrpo.core.launch import DataParallel, fsdp
from fgrpo.core.launch.deepspeed import check_deepspeed

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
CONFIGS = HERE.parent / "recipes" / "accelerate"


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory) -> str:
    from fgrpo.models.testing import build_tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny-sd3")
    build_tiny_sd3_pipeline(path, sd35=True)
    return str(path)


def two_process_recipe(path: Path, model: dict, sampler: dict, objective: dict, evaluation: dict, **train) -> Path:
    """The recipe of a sharded run written to ``path``: two prompts per iteration (one per process),
    3 iterations, a checkpoint every iteration, an EMA; ``train`` sets group_size and lr."""
    data = {
        "seed": 0,
        "model": model,
        "sampler": sampler,
        "reward": {"name": "target-distance"},  # continuous in the pixels: tiny weight differences stay tiny
        "objective": objective,
        "prompts": {
            "name": "list",
            "train": ["a red circle", "two blue squares", "a green triangle", "one yellow star"],
            "test": ["a red square", "a blue circle"],
        },
        "train": {
            "iterations": 3,
            "prompts_per_iteration": 2,
            "micro_batch_size": 1,
            "adam_eps": 1e-6,
            "drop_zero_advantage": False,
            "checkpoint_every": 1,
            "ema_decay": 0.9,
            **train,
        },
        "eval": evaluation,
        "log": {"plots": False, "quiet": True, "sample_grid": False},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def sd3_recipe(folder: Path, pipeline: str, *, lora: bool) -> Path:
    """Two prompts per iteration (one per process), CFG, KL to the base with LoRA, an EMA, an
    evaluation at the start and every 2 iterations, a checkpoint every iteration."""
    return two_process_recipe(
        folder / ("sd3-lora.yaml" if lora else "sd3-full.yaml"),
        {
            "name": "sd3",
            "path": pipeline,
            "device": "cpu",
            "max_sequence_length": 16,
            "lora": {"rank": 4} if lora else None,
        },
        {"name": "full", "steps": 2, "kernel": {"name": "sde", "eta": 0.7}},
        {"name": "grpo", "clip_range": 1e-3, "kl_beta": 0.01 if lora else 0.0},
        {"every": 2, "samples_per_prompt": 1, "steps": 2},
        group_size=2,
        lr=1e-2 if lora else 1e-3,
    )


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timing(table: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(("time_", "samples_per_s", "threads"))} for row in table]


def last(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "last"


def optimizer_tensors(run_dir: Path) -> dict:
    state = torch.load(last(run_dir) / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    return {(i, k): v for i, per_param in state.items() for k, v in per_param.items()}


SHARDED = [
    pytest.param("fsdp", "lora", id="fsdp-lora"),
    pytest.param("fsdp", "full", id="fsdp-full", marks=pytest.mark.slow),
    pytest.param("deepspeed", "lora", id="deepspeed-lora", marks=pytest.mark.slow),
    pytest.param("deepspeed", "full", id="deepspeed-full", marks=pytest.mark.slow),
    # ZeRO-3 and offloading, from a DeepSpeed config file (tests/sharded_worker.py): about 5 minutes each
    pytest.param("zero3", "lora", id="zero3-lora", marks=pytest.mark.slow),
    pytest.param("zero3", "full", id="zero3-full", marks=pytest.mark.slow),
    pytest.param("zero2-offload", "full", id="zero2-offload-full", marks=pytest.mark.slow),
    pytest.param("zero3-offload", "lora", id="zero3-offload-lora", marks=pytest.mark.slow),
]
#: what the start-up line calls each kind
DESCRIPTIONS = {
    "fsdp": "sharded (FSDP2)",
    "deepspeed": "sharded (DeepSpeed ZeRO-2)",
    "zero3": "sharded (DeepSpeed ZeRO-3)",
    "zero2-offload": "sharded (DeepSpeed ZeRO-2, optimizer offloaded to cpu)",
    "zero3-offload": "sharded (DeepSpeed ZeRO-3, optimizer offloaded to cpu, param offloaded to cpu)",
}


def needs(kind: str) -> None:
    if kind != "fsdp":
        pytest.importorskip("deepspeed", reason="DeepSpeed runs need the deepspeed package (fgrpo-core[deepspeed])")


def run_worker(kind: str, recipe: Path, runs: Path) -> list[dict]:
    """tests/sharded_worker.py on 2 processes: ``recipe`` for 3 iterations data parallel, sharded as
    ``kind``, resumed and crossed, each in its folder under ``runs``; the two processes' reports."""
    done = subprocess.run(
        [*torchrun(), str(HERE / "sharded_worker.py"), kind, str(recipe), str(runs), "3"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        timeout=900,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((runs / f"report-rank{r}.json").read_text()) for r in (0, 1)]


def assert_rows_close(reference: list[dict], other: list[dict], rel: float) -> None:
    """The same metrics rows, their float values (all but the timings) within ``rel``."""
    for x, y in zip(reference, other, strict=True):
        assert x.keys() == y.keys()
        for key, value in x.items():
            if isinstance(value, float) and not key.startswith(("time_", "samples_per_s")):
                assert y[key] == pytest.approx(value, rel=rel, abs=1e-6), key


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind, variant", SHARDED)
def test_sharded_run_equals_data_parallel_and_resumes_exactly(kind, variant, tiny_sd3, tmp_path):
    """FSDP2 (one test in the default run, about 35 s), DeepSpeed ZeRO-2 (slow: DeepSpeed
    compiles its CPU communication op once, about 100 s), ZeRO-3 and CPU offloading (slow), LoRA
    and full fine-tuning."""
    needs(kind)
    recipe = sd3_recipe(tmp_path, tiny_sd3, lora=variant == "lora")
    runs = tmp_path / "runs"
    report = run_worker(kind, recipe, runs)
    ddp, sharded = report[0]["ddp"], report[0]["sharded"]
    assert not ddp["sharded"] and ddp["stepped_numel"] == ddp["trainable_numel"]
    # sharded for real: each process holds and steps about half of the optimizer state
    assert (
        sharded["kind"] == ("FSDP" if kind == "fsdp" else "DEEPSPEED")
        and sharded["sharded"]
        and sharded["dtensor"] == (kind == "fsdp")
    )
    assert sharded["description"] == DESCRIPTIONS[kind]
    assert sharded["trainable_numel"] / 2 <= sharded["stepped_numel"] < sharded["trainable_numel"]
    # ZeRO-3: no process holds any weight of the network (trained or frozen) between forwards
    expected = sharded["network_weights"] if kind.startswith("zero3") else 0
    assert sharded["partitioned_weights"] == expected and sharded["network_weights"] > 0
    assert report[0]["resumed"]["start"] == 2
    # process 1 trains on fewer samples: it pads with passes that change nothing, process 0 never
    assert report[1]["sharded"]["padding_passes"] > 0 and report[0]["sharded"]["padding_passes"] == 0
    assert report[1]["ddp"]["padding_passes"] == 0

    # on-policy sharded as under data parallel: the first ratio of every iteration is 1 (within
    # fgrpo check's 1e-6: one pair per forward here, the rollout's forwards held two samples)
    for name in ("ddp", "sharded", "resumed"):
        deviations = [r["first_ratio_deviation"] for r in rows(runs / name) if "first_ratio_deviation" in r]
        assert len(deviations) == 3 and max(deviations) <= 1e-6, (name, deviations)
    # the same run: weights, EMA, optimizer moments and metrics within float tolerance
    files = ["trainable.safetensors", "ema.safetensors"] + (
        ["export/pytorch_lora_weights.safetensors"] if variant == "lora" else []
    )
    for name in files:
        a, b = load_file(str(last(runs / "ddp") / name)), load_file(str(last(runs / "sharded") / name))
        assert a.keys() == b.keys() and a, name
        for key in a:
            torch.testing.assert_close(
                b[key], a[key], rtol=0, atol=1e-5, msg=lambda m, name=name, key=key: f"{name} {key}: {m}"
            )
    a, b = optimizer_tensors(runs / "ddp"), optimizer_tensors(runs / "sharded")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
    assert_rows_close(rows(runs / "ddp"), rows(runs / "sharded"), rel=1e-4)
    # resumed sharded from a sharded run's checkpoint: bit for bit the uninterrupted run
    for name in files + ["optimizer.pt"]:
        if name.endswith(".safetensors"):
            a, b = load_file(str(last(runs / "sharded") / name)), load_file(str(last(runs / "resumed") / name))
            assert all(torch.equal(a[k], b[k]) for k in a), name
    a, b = optimizer_tensors(runs / "sharded"), optimizer_tensors(runs / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert without_timing(rows(runs / "sharded")) == without_timing(rows(runs / "resumed"))
    # a data-parallel checkpoint resumes sharded: the same run within float tolerance
    assert report[0]["crossed"]["start"] == 2 and report[0]["crossed"]["sharded"]
    for name in files:
        a, b = load_file(str(last(runs / "sharded") / name)), load_file(str(last(runs / "crossed") / name))
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
    # the checkpoint of a sharded run reads back as any other: diffusers loads its LoRA export
    if variant == "lora":
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
        pipe.load_lora_weights(str(last(runs / "sharded") / "export"))
        assert any("lora" in name for name, _ in pipe.transformer.named_parameters())


def launch(config: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(CONFIGS / config),
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
            "-m",
            "fgrpo.core.cli",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "config, shown",
    [
        ("fsdp-lora.yaml", "FSDP2"),
        ("deepspeed-zero2.yaml", "DeepSpeed ZeRO-2"),
        # DeepSpeed's default persistence threshold keeps the tiny network's weights whole between forwards
        ("deepspeed-zero3.yaml", "DeepSpeed ZeRO-3"),
        ("deepspeed-zero3-offload.yaml", "DeepSpeed ZeRO-3, optimizer offloaded to cpu, param offloaded to cpu"),
    ],
)
def test_shipped_config_launches_bf16_on_policy_and_resumes_exactly(config, shown, tiny_sd3, tmp_path):
    """`accelerate launch --config_file recipes/accelerate/CONFIG` (bf16) on a machine without GPUs:
    two sharded processes over gloo; `fgrpo check` finds the first ratio exactly 1; a run resumed
    from its bf16 checkpoint ends bit for bit where the uninterrupted one does (about 100 s each)."""
    needs("deepspeed" if config.startswith("deepspeed") else "fsdp")
    recipe = sd3_recipe(tmp_path, tiny_sd3, lora=True)
    # the update's forward passes hold the rollout's batches (DeepSpeed's bf16 rounds by batch size)
    check = launch(config, "check", str(recipe), "--set", "train.micro_batch_size=0", cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.count("on-policy check passed") == 2
    assert f"2 process(es), sharded ({shown})" in check.stdout and "mixed precision bf16" in check.stdout
    assert "largest |ratio - 1| before the first optimizer step: 0.000e+00" in check.stdout
    for out, iterations, more in (("straight", 3, []), ("resumed", 2, []), ("resumed", 3, ["--resume"])):
        done = launch(
            config,
            "compose",
            str(recipe),
            "--out",
            str(tmp_path / out),
            "--quiet",
            "--set",
            f"train.iterations={iterations}",
            *more,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    for name in ("trainable.safetensors", "ema.safetensors", "export/pytorch_lora_weights.safetensors"):
        a, b = load_file(str(last(tmp_path / "straight") / name)), load_file(str(last(tmp_path / "resumed") / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    a = torch.load(last(tmp_path / "straight") / "optimizer.pt", weights_only=True)["optimizer"]
    b = torch.load(last(tmp_path / "resumed") / "optimizer.pt", weights_only=True)["optimizer"]
    assert a.keys() == b.keys()  # DeepSpeed's bf16 keeps float32 master weights: saved with the moments

    def flat(o):
        return [t for per_param in o["state"].values() for t in per_param.values()] + list(
            o.get("fp32_weights", {}).values()
        )

    assert all(torch.equal(x, y) for x, y in zip(flat(a), flat(b), strict=True))
    assert without_timing(rows(tmp_path / "straight")) == without_timing(rows(tmp_path / "resumed"))


# --- what cannot be sharded is refused ---------------------------------------------------------


def fsdp_accelerator(version: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version, mixed_precision_policy=None))
    )


def test_a_policy_without_trainable_module_is_refused():
    from fgrpo.core.testing import GaussianPolicy

    policy = GaussianPolicy()
    optimizer = torch.optim.AdamW(list(policy.trainable_parameters()))
    with pytest.raises(RecipeError, match="cannot be sharded: it names no trainable_module"):
        fsdp.shard_policy(fsdp_accelerator(), policy, optimizer)


def test_fsdp_version_1_is_refused():
    module = torch.nn.Linear(2, 2)
    policy = SimpleNamespace(trainable_module=module, trainable_parameters=module.parameters)
    with pytest.raises(RecipeError, match="fsdp_version 1 is not supported") as info:
        fsdp.shard_policy(fsdp_accelerator(1), policy, torch.optim.AdamW(module.parameters()))
    assert info.value.errors[0].key == "accelerate"


def test_trainable_parameters_outside_the_module_are_refused():
    module, extra = torch.nn.Linear(2, 2), torch.nn.Parameter(torch.zeros(2))
    policy = SimpleNamespace(trainable_module=module)
    with pytest.raises(RecipeError, match="outside its trainable_module"):
        fsdp.shard_policy(fsdp_accelerator(), policy, torch.optim.AdamW([*module.parameters(), extra]))


def test_whole_optimizer_state_of_an_unsharded_run_is_its_state_dict():
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.full((3,), 0.5)
    optimizer.step()
    data_parallel = SimpleNamespace(distributed_type="MULTI_CPU")
    saved = DataParallel(data_parallel).optimizer_state(optimizer, [p])
    torch.testing.assert_close(
        saved["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"], rtol=0, atol=0
    )
    q = torch.nn.Parameter(torch.ones(3))
    other = torch.optim.AdamW([q], lr=0.1)
    DataParallel(data_parallel).load_optimizer_state(other, [q], saved)
    assert torch.equal(other.state_dict()["state"][0]["exp_avg_sq"], saved["state"][0]["exp_avg_sq"])


def deepspeed_accelerator(stage: int, optimizer: str = "none", param: str = "none") -> SimpleNamespace:
    config = {
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": optimizer},
            "offload_param": {"device": param},
        }
    }
    return SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage, deepspeed_config=config))
    )


@pytest.mark.parametrize(
    "stage, optimizer, param",
    [
        (2, "none", "none"),
        (2, "cpu", "none"),
        (3, "none", "none"),
        (3, "cpu", "none"),
        (3, "cpu", "cpu"),
        (3, "none", "cpu"),
    ],
)
def test_deepspeed_zero2_and_zero3_with_cpu_offloading_run(stage, optimizer, param, monkeypatch):
    from fgrpo.core.launch.deepspeed import DeepSpeedZeRO2, DeepSpeedZeRO3, stage_class

    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", raising=False)
    accelerator = deepspeed_accelerator(stage, optimizer, param)
    check_deepspeed(accelerator)
    assert stage_class(accelerator) is (DeepSpeedZeRO3 if stage == 3 else DeepSpeedZeRO2)
    served = stage_class(accelerator)(accelerator)
    assert served.sharded and served.sharded_weights == (stage == 3)
    offloads = "".join(
        f", {what} offloaded to cpu"
        for what, device in (("optimizer", optimizer), ("param", param))
        if device == "cpu"
    )
    assert served.description == f"sharded (DeepSpeed ZeRO-{stage}{offloads})"


def test_what_deepspeed_runs_not_is_refused_all_at_once(monkeypatch):
    with pytest.raises(RecipeError) as info:
        check_deepspeed(deepspeed_accelerator(1, optimizer="nvme", param="cpu"))
    message = str(info.value)
    assert "zero_stage 1 is not supported" in message
    assert "offload_optimizer to 'nvme' is not supported" in message and "allowed: none, cpu" in message
    assert "offload_param to 'cpu' needs zero_stage 3 (got 1)" in message
    assert [e.key for e in info.value.errors] == ["accelerate"] * 3
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    with pytest.raises(
        RecipeError,
        match="zero3_init_flag true is not supported: transformers would load the frozen text encoders partitioned",
    ):
        check_deepspeed(deepspeed_accelerator(3))
    check_deepspeed(deepspeed_accelerator(2))  # the flag means nothing below stage 3


def test_a_deepspeed_launch_accelerate_did_not_set_up_is_refused(root, monkeypatch, capsys):
    """`ACCELERATE_USE_DEEPSPEED=true` without a launcher's processes: not run as something else."""
    from accelerate.state import AcceleratorState

    from fgrpo.core import cli

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        assert cli.main(["check", str(root / "recipes" / "vector.yaml")]) == 2
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next test's Accelerator starts afresh
    assert "the launch asks for DeepSpeed but accelerate set up NO" in capsys.readouterr().err
