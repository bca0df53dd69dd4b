"""The load plan (fgrpo.models.load_plan): where each network of a diffusers backbone goes when it
loads, and that the policy moves each one there once (a text encoder kept on the CPU never passes
through the accelerator); under FSDP2 no process holds the transformer whole (load_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from _helpers import torchrun
from fgrpo.core.launch.start import launch_class
from fgrpo.models.flux2 import Flux2Policy
from fgrpo.models.load_plan import Placement, plan
from fgrpo.models.sd3 import SD3Policy
from fgrpo.models.wan import WanPolicy

HERE = Path(__file__).parent
BF16, F32 = torch.bfloat16, torch.float32


def test_the_plan_keeps_text_encoders_on_the_host_and_shards_the_transformer_under_fsdp2():
    keys = {"dtype": "bf16", "vae_dtype": "float32", "text_encoder_device": "cpu", "device": "cuda"}
    assert plan(SD3Policy, keys, shards=True) == [
        Placement("transformer", "accelerator", BF16, True),
        Placement("vae", "accelerator", F32, False),
        Placement("text_encoder", "host", BF16, False),
        Placement("text_encoder_2", "host", BF16, False),
        Placement("text_encoder_3", "host", BF16, False),
    ]
    # the recipe of FLUX.2 [dev]: the 24B Mistral never on the GPU, the 32B transformer in shards
    flux2 = {"dtype": "bfloat16", "text_encoder_device": "cpu", "lora": {"rank": 64}}
    assert [(p.name, p.role, p.sharded) for p in plan(Flux2Policy, flux2, shards=True)] == [
        ("transformer", "accelerator", True),
        ("vae", "accelerator", False),
        ("text_encoder", "host", False),
    ]
    # Wan 2.2 A14B: both experts sit in the module FSDP splits; data parallel loads all whole
    assert [p.name for p in plan(WanPolicy, {}, shards=True) if p.sharded] == ["transformer", "transformer_2"]
    assert not any(p.sharded for p in plan(WanPolicy, {}))
    # which launch kinds load shard by shard is theirs to say (fgrpo.core.launch)
    assert [k for k in ("MULTI_GPU", "FSDP", "DEEPSPEED") if launch_class(k).loads_shards] == ["FSDP"]
    # full fine-tuning loads shard by shard too (the trained weights read into their shards)
    assert [p.name for p in plan(SD3Policy, {"lora": None}, shards=True) if p.sharded] == ["transformer"]
    # no text_encoder_device: the text encoders go where the transformer goes
    assert {p.role for p in plan(SD3Policy, {"device": "cpu"})} == {"host"}


def test_fsdp2_without_accelerates_own_low_memory_load_and_zero3_load_shards(monkeypatch):
    from types import SimpleNamespace

    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    from fgrpo.core.launch import loads_shards

    def launched(kind, stages=(), **plugin):
        deepspeed = {f"p{i}": SimpleNamespace(zero_stage=s, selected=i == 0) for i, s in enumerate(stages)}
        monkeypatch.setattr(
            AcceleratorState,
            "_shared_state",
            {
                "distributed_type": kind,
                "fsdp_plugin": plugin and SimpleNamespace(**plugin),
                "deepspeed_plugins": deepspeed,
            },
        )
        return loads_shards()

    assert launched(DistributedType.FSDP, cpu_ram_efficient_loading=False)
    assert not launched(DistributedType.FSDP, cpu_ram_efficient_loading=True)
    assert not launched(DistributedType.MULTI_GPU)
    # DeepSpeed: ZeRO-3 (the selected plugin's stage) loads shard by shard, ZeRO-2 whole
    assert launched(DistributedType.DEEPSPEED, stages=(3, 2))
    assert not launched(DistributedType.DEEPSPEED, stages=(2, 3)) and not launched(DistributedType.DEEPSPEED)
    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    assert not loads_shards()  # no Accelerator made


@pytest.mark.parametrize(
    "policy_class, builder, keys",
    [
        (SD3Policy, "build_tiny_sd3_pipeline", {"max_sequence_length": 8}),
        (Flux2Policy, "build_tiny_flux2_pipeline", {"max_sequence_length": 48, "text_encoder_out_layers": [1, 2, 2]}),
    ],
    ids=["sd3", "flux2"],
)
def test_each_network_moves_once_and_text_encoders_never_reach_the_accelerator(
    policy_class, builder, keys, monkeypatch
):
    """The meta device stands in for the accelerator. The old order (the whole pipeline to the
    device, then the text encoders back to ``text_device``) sends them there first."""
    from fgrpo.models import testing

    pipe = getattr(testing, builder)()
    names = {id(m): n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    moves: list[tuple[str, torch.device | None, torch.dtype | None]] = []
    original = torch.nn.Module.to

    def spy(module, *args, **kwargs):
        if id(module) in names:
            device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
            moves.append((names[id(module)], device, dtype))
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy)
    meta = torch.device("meta")
    try:
        policy = policy_class.from_pipeline(
            pipe, device=meta, text_encoder_device="cpu", dtype="bfloat16", vae_dtype="float32", **keys
        )
    except NotImplementedError:  # a module moved off the meta device: the records below say which
        policy = None
    text = policy_class.text_encoder_names
    assert [m for m in moves if m[0] in text and m[1] is not None and m[1].type != "cpu"] == []
    moved = sorted(n for n, _, _ in moves)
    assert moved == sorted(names.values()), "each network moves exactly once"
    cast = {n: dtype for n, _, dtype in moves}
    assert cast["transformer"] == BF16 and cast["vae"] is None and all(cast[n] == BF16 for n in text)
    assert policy is not None
    for name in text:
        assert {(p.device.type, p.dtype) for p in getattr(pipe, name).parameters()} == {("cpu", BF16)}
    assert {p.device for p in pipe.transformer.parameters()} == {meta}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backbone, dtype, launch_kind",
    [
        ("sd3", "float32", "fsdp"),
        pytest.param("sd3", "bfloat16", "fsdp", marks=pytest.mark.slow),
        # both experts sharded; Wan keeps some modules in float32 under bf16 (_keep_in_fp32_modules)
        pytest.param("wan22", "bfloat16", "fsdp", marks=pytest.mark.slow),
        # full fine-tuning: the trained weights too (loading whole, a process held 1,295,488 bytes);
        # under mixed precision accelerate upcasts them to float32 on meta, and each shard is read
        # through the load dtype (bf16), as the whole load's weights are upcast
        pytest.param("sd3", "float32", "fsdp-full", marks=pytest.mark.slow),
        pytest.param("sd3", "bfloat16", "fsdp-full-bf16", marks=pytest.mark.slow),
    ],
)
def test_under_fsdp2_each_process_reads_only_its_shard_and_gets_the_whole_loads_weights(
    backbone, dtype, launch_kind, tmp_path
):
    run_load_worker(backbone, dtype, launch_kind, tmp_path)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"load-rank{rank}.json").read_text())
        # before the launch shards it, the transformer's weights take (almost) no memory: one
        # element per weight, against the whole model a whole load holds in every process
        assert report["held_before_sharding"] <= report["weights"] * 4
        assert report["held_before_sharding"] * 100 < report["whole_bytes"]
        # what this process read of the transformer's files: exactly the rows of its shards
        assert report["read"] == report["shard_rows"] and sum(report["read"].values()) < report["whole_numel"]
        assert sum(report["read"].values()) > 0
        # the same weights, LoRA and buffers as the whole load, bit for bit
        assert report["mismatches"] == [] and report["compared"] > 0


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backbone, launch_kind",
    [
        pytest.param("sd3", "zero3", marks=pytest.mark.slow),  # FSDP2 keeps the default suite's case
        # DeepSpeed's bf16 mode: the partitions and the LoRA matrices cast to bf16, as the engine casts
        pytest.param("sd3", "zero3-bf16", marks=pytest.mark.slow),
        # the partitions in CPU memory (offload_param), stepped by AdamW there
        pytest.param("sd3", "zero3-offload", marks=pytest.mark.slow),
        # full fine-tuning: the trained weights too (DeepSpeed makes its float32 masters from them)
        pytest.param("sd3", "zero3-full", marks=pytest.mark.slow),
        pytest.param("wan22", "zero3", marks=pytest.mark.slow),
    ],
)
def test_under_zero3_each_process_reads_only_its_partitions_and_gets_the_whole_loads_weights(
    backbone, launch_kind, tmp_path
):
    """DeepSpeed ZeRO-3 (fgrpo.core.launch.zero3_load): each weight becomes a partitioned
    parameter from the rows of the file that hold this process's partition. Loading whole (the
    launch before it loaded shards), a process held 1,295,488 bytes of the transformer's weights
    before DeepSpeed partitioned them, the whole model."""
    pytest.importorskip("deepspeed", reason="ZeRO-3 needs the deepspeed package (fgrpo-core[deepspeed])")
    run_load_worker(backbone, "float32", launch_kind, tmp_path)
    reports = [json.loads((tmp_path / f"load-rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        # before DeepSpeed takes the module, one element per transformer weight, not the model
        assert report["held_before_sharding"] <= report["weights"] * 4
        assert report["held_before_sharding"] * 100 < report["whole_bytes"]
        partitions = report["partitions"]
        assert len(partitions) == report["weights"]
        for name, (numel, size, kept, row) in partitions.items():
            # DeepSpeed's layout: the weight flattened, padded to a multiple of the 2 processes
            assert size == -(-numel // 2), name
            # what the process read of this weight: the file's rows that hold its partition's
            # elements, so at most 2 rows (less one element each) more than the partition
            read = report["read"].get(name, 0)
            assert kept <= read <= kept + 2 * (row - 1) and (read == 0) == (kept == 0), (name, read, kept, row)
        # of the files, only the weights' partitions and the persistent buffers, read whole
        assert set(report["read"]) - set(partitions) == set(report["buffers"])
        # what it holds once partitioned: its partitions, half the weights (and the padding)
        assert report["partition_bytes"] == sum(s for _, s, _, _ in partitions.values()) * (
            2 if launch_kind.endswith("bf16") else 4
        )
        # the same weights, LoRA and buffers as the whole load (DeepSpeed's bf16: cast), bit for bit
        assert report["mismatches"] == [] and report["compared"] > 0
    # the two partitions of each weight hold all its elements once
    first, second = (r["partitions"] for r in reports)
    assert all(first[n][2] + second[n][2] == first[n][0] for n in first)


def run_load_worker(backbone: str, dtype: str, launch_kind: str, tmp_path) -> None:
    """load_worker.py on two processes over a tiny pipeline of ``backbone`` saved under ``tmp_path``;
    each writes its report to ``tmp_path/load-rank<N>.json``."""
    from fgrpo.models.testing import build_tiny_sd3_pipeline, build_tiny_wan22_pipeline

    folder = tmp_path / backbone
    if backbone == "sd3":
        build_tiny_sd3_pipeline(folder, sd35=True)
    else:
        build_tiny_wan22_pipeline(folder)
    done = subprocess.run(
        [*torchrun(), str(HERE / "load_worker.py"), backbone, str(folder), dtype, str(tmp_path), launch_kind],
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
