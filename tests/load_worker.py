"""Load a policy (LoRA, or fully fine-tuned) under an FSDP2 or DeepSpeed ZeRO-3 launch (under
torchrun, 2 CPU processes over gloo), shard it as a run does, and write ``OUT/load-rankR.json``:
what the process held of the transformer's weights before sharding, which elements of the
transformer's safetensors files it read (counted at ``safetensors.safe_open``, whoever reads),
its shards' sizes (ZeRO-3: each weight's elements, partition size, the elements this process's
partition holds, and row length), and every weight, LoRA matrix and buffer that differs from a
whole load of the same folder with the same seed.

Usage: load_worker.py BACKBONE PIPELINE_FOLDER DTYPE OUT [LAUNCH] (BACKBONE: sd3, or wan22: two
experts; LAUNCH: fsdp, the default, zero3 or zero3-offload, with ``-full`` (full fine-tuning
instead of LoRA) and / or ``-bf16`` (mixed precision bf16))
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import safetensors
import safetensors.torch
import torch

from sharded_worker import launch_environment

READ: Counter = Counter()


BACKBONES = {  # policy class, model keys, the networks FSDP2 shards
    "sd3": ("fgrpo.models.sd3:SD3Policy", {"max_sequence_length": 8}, ["transformer"]),
    "wan22": (
        "fgrpo.models.wan:WanPolicy",
        {"max_sequence_length": 8, "resolution": 32, "num_frames": 5},
        ["transformer", "transformer_2"],
    ),
}


class CountingSlice:
    def __init__(self, inner, key: str):
        self.inner, self.key = inner, key

    def __getitem__(self, index):
        out = self.inner[index]
        READ[self.key] += out.numel()
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class CountingOpen:
    """``safe_open`` that counts the elements read from a transformer's file."""

    def __init__(self, filename, *args, **kwargs):
        self.inner = ORIGINAL(filename, *args, **kwargs)
        self.folder = Path(str(filename)).parent.name
        self.counted = self.folder.startswith("transformer")

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def get_tensor(self, key):
        out = self.inner.get_tensor(key)
        if self.counted:
            READ[f"{self.folder}/{key}"] += out.numel()
        return out

    def get_slice(self, key):
        inner = self.inner.get_slice(key)
        return CountingSlice(inner, f"{self.folder}/{key}") if self.counted else inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


ORIGINAL = safetensors.safe_open


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main() -> None:
    backbone, folder, dtype, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    kind = sys.argv[5] if len(sys.argv) > 5 else "fsdp"
    policy_path, keys, sharded = BACKBONES[backbone]
    bf16, fine_tuned = "-bf16" in kind, "-full" in kind
    fsdp = kind.startswith("fsdp")
    os.environ.update(launch_environment(kind.replace("-bf16", "").replace("-full", ""), out))
    if bf16:
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    safetensors.safe_open = safetensors.torch.safe_open = CountingOpen

    from torch.distributed.tensor import DTensor

    from fgrpo.core import launch

    module, _, name = policy_path.partition(":")
    policy_class = getattr(importlib.import_module(module), name)
    parallel = launch.start()
    keys = {**keys, "device": "cpu", "dtype": dtype, "lora": None if fine_tuned else {"rank": 4, "init": "gaussian"}}
    torch.manual_seed(0)
    policy = policy_class(path=folder, **keys)
    networks = {n: getattr(policy.pipeline, n) for n in sharded}
    base = [p for m in networks.values() for n, p in m.named_parameters() if "lora_" not in n]
    held = storage_bytes(base)
    optimizer = torch.optim.AdamW([p for p in policy.trainable_parameters() if p.requires_grad], lr=1e-3)
    parallel.prepare(policy, optimizer, SimpleNamespace(max_grad_norm=1.0))  # DeepSpeed reads the clipping
    read = dict(READ)

    # the whole load of the same folder as a data-parallel run loads it, with the same seed (the
    # LoRA matrices are the same draw: loading draws as much from the global RNG either way)
    safetensors.safe_open = safetensors.torch.safe_open = ORIGINAL
    launch.loads_shards = lambda: False
    torch.manual_seed(0)
    whole = policy_class(path=folder, **keys).pipeline
    assert not any(isinstance(p, DTensor) for p in whole.transformer.parameters())  # loaded whole
    shard_rows, mismatches, compared, whole_bytes, whole_numel = {}, [], 0, 0, 0
    # ZeRO-3: weight -> [its elements, its partitions' size, the elements this process's holds, its row length]
    partitions: dict[str, list[int]] = {}
    buffers: list[str] = []  # the persistent buffers (read whole)
    for component, network in networks.items():
        expected = dict(getattr(whole, component).state_dict())
        persistent = {n for n, _ in network.named_buffers() if n in expected}
        buffers += [f"{component}/{n}" for n in sorted(persistent)]
        for name, value in network.state_dict(keep_vars=True).items():  # the same order on every process
            full = launch.full(value).detach()
            if launch.is_partitioned(value) and "lora_" not in name:
                size, rank = value.ds_tensor.numel(), torch.distributed.get_rank()
                kept = max(0, min(size, value.ds_numel - size * rank))
                row = full[0].numel() if full.dim() else 1
                partitions[f"{component}/{name.replace('.base_layer', '')}"] = [value.ds_numel, size, kept, row]
            compared += 1
            want = expected[name]
            if bf16 and isinstance(value, torch.nn.Parameter) and want.is_floating_point():
                # what the launch makes of the whole load's weights: accelerate's FSDP2 upcasts the
                # trained ones to float32; DeepSpeed's bf16 mode casts every weight to bf16
                want = (
                    want.to(torch.float32 if value.requires_grad else want.dtype) if fsdp else want.to(torch.bfloat16)
                )
            if full.dtype != want.dtype or not torch.equal(full, want):
                mismatches.append(f"{component}/{name}")
            if "lora_" in name:
                continue
            whole_bytes += full.numel() * full.element_size()
            whole_numel += full.numel()
            local = value.to_local() if launch.is_sharded_tensor(value) else value.detach()
            if local.numel() and (launch.is_sharded_tensor(value) or name in persistent):
                shard_rows[f"{component}/{name.replace('.base_layer', '')}"] = local.numel()
    report = {
        "held_before_sharding": held,
        "weights": len(base),
        "whole_bytes": whole_bytes,
        "whole_numel": whole_numel,
        "read": read,
        "shard_rows": shard_rows,
        "partitions": partitions,
        "buffers": buffers,
        "partition_bytes": sum(
            launch.local(p).numel() * launch.local(p).element_size()
            for m in networks.values()
            for n, p in m.named_parameters()
            if launch.is_partitioned(p) and "lora_" not in n
        ),
        "mismatches": mismatches,
        "compared": compared,
    }
    (out / f"load-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(report, indent=1))
    # leave together: a process that exits while gloo's threads still serve the other one aborts
    # ("terminate called without an active exception")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
