"""Load a LoRA policy under an FSDP2 launch (under torchrun, 2 CPU processes over gloo), shard it
as a run does, and write ``OUT/load-rankR.json``: what the process held of the transformer's
weights before sharding, which elements of the transformer's safetensors files it read (counted
at ``safetensors.safe_open``, whoever reads), its shards' sizes, and every weight, LoRA matrix and
buffer that differs from a whole load of the same folder with the same seed.

Usage: load_worker.py PIPELINE_FOLDER DTYPE OUT
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from sharded_worker import LAUNCHES

READ: Counter = Counter()


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
        self.counted = "transformer" in Path(str(filename)).parent.name

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def get_tensor(self, key):
        out = self.inner.get_tensor(key)
        if self.counted:
            READ[key] += out.numel()
        return out

    def get_slice(self, key):
        return CountingSlice(self.inner.get_slice(key), key) if self.counted else self.inner.get_slice(key)

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
    folder, dtype, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    os.environ.update(LAUNCHES["fsdp"])
    safetensors.safe_open = safetensors.torch.safe_open = CountingOpen

    from diffusers import StableDiffusion3Pipeline

    from fgrpo.core import launch
    from fgrpo.models.sd3 import SD3Policy

    parallel = launch.start()
    keys = {"device": "cpu", "dtype": dtype, "max_sequence_length": 8, "lora": {"rank": 4, "init": "gaussian"}}
    torch.manual_seed(0)
    policy = SD3Policy(path=folder, **keys)
    base = [p for n, p in policy.transformer.named_parameters() if "lora_" not in n]
    held = storage_bytes(base)
    optimizer = torch.optim.AdamW([p for p in policy.trainable_parameters() if p.requires_grad], lr=1e-3)
    parallel.prepare(policy, optimizer, None)
    read = dict(READ)

    # the whole load of the same folder, with the same seed (its LoRA matrices are the same draw)
    safetensors.safe_open = safetensors.torch.safe_open = ORIGINAL
    whole_pipe = StableDiffusion3Pipeline.from_pretrained(folder, torch_dtype=getattr(torch, dtype))
    torch.manual_seed(0)
    whole = SD3Policy.from_pipeline(whole_pipe, path=folder, **keys).transformer
    expected = dict(whole.state_dict())
    shard_rows, mismatches = {}, []
    persistent = {n for n, _ in whole.named_buffers() if n in expected}
    for name, value in policy.transformer.state_dict().items():  # the same order on every process
        full = launch.full(value)
        if full.dtype != expected[name].dtype or not torch.equal(full, expected[name]):
            mismatches.append(name)
        if "lora_" in name:
            continue
        key = name.replace(".base_layer", "")
        local = value.to_local() if launch.is_sharded_tensor(value) else value
        if local.numel() and (launch.is_sharded_tensor(value) or name in persistent):
            shard_rows[key] = local.numel()
    report = {
        "held_before_sharding": held,
        "weights": len(base),
        "whole_bytes": sum(t.numel() * t.element_size() for n, t in expected.items() if "lora_" not in n),
        "whole_numel": sum(t.numel() for n, t in expected.items() if "lora_" not in n),
        "read": read,
        "shard_rows": shard_rows,
        "mismatches": mismatches,
        "compared": len(expected),
    }
    (out / f"load-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
