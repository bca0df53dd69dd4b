"""Atomic checkpoints: a folder is written under a temporary name, then renamed; ``last`` is a
symlink replaced atomically, so a kill at any moment never leaves a half checkpoint as ``last``.

Layout of ``checkpoints/iter_NNNNNN/``::

    trainable.safetensors   the policy's trainable weights (LoRA or full)
    ema.safetensors         their EMA, when enabled
    optimizer.pt            optimizer and LR-schedule state (tensors and numbers only)
    rng-rankR.pt            each process's torch RNG states
    state.json              iteration, sampler state, data position, the resolved recipe
Loading uses ``torch.load(weights_only=True)`` and safetensors: nothing arbitrary is unpickled.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TRAINABLE = "trainable.safetensors"
EMA = "ema.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "state.json"
# recipe keys that may differ on resume: extending a run, or how it is displayed
RESUMABLE_CHANGES = ("train.iterations", "log")  # a key or a whole section (every log.* key)


def folder_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for item in path.iterdir():
        if item.is_file():
            with item.open("rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def write(
    root: Path,
    iteration: int,
    *,
    trainable: Mapping[str, torch.Tensor],
    ema: Mapping[str, torch.Tensor] | None,
    optimizer: Mapping[str, Any],
    rng: Mapping[int, Any],
    state: Mapping[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint ``iteration`` under ``root`` (checkpoints/) and point ``last`` at it."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / folder_name(iteration)
    tmp = root / f".tmp-{folder_name(iteration)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_tensors(trainable, tmp / TRAINABLE)
    if ema is not None:
        save_tensors(ema, tmp / EMA)
    torch.save(dict(optimizer), tmp / OPTIMIZER)
    for rank, states in rng.items():
        torch.save(states, tmp / f"rng-rank{rank}.pt")
    (tmp / STATE).write_text(json.dumps(dict(state), indent=1, sort_keys=True))
    _fsync_tree(tmp)
    if final.exists():  # a re-run of the same iteration after a resume: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _point_last(root, final.name)
    _fsync_dir(root)
    prune(root, keep)
    return final


def _point_last(root: Path, name: str) -> None:
    link = root / "last"
    tmp_link = root / f".last-{os.getpid()}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    os.symlink(name, tmp_link)
    os.replace(tmp_link, link)


def prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest iteration folders (never the one ``last`` names); drop temp folders."""
    last = latest(root)
    folders = sorted(p for p in root.glob("iter_*") if p.is_dir())
    for old in folders[:-keep] if keep else folders:
        if last is None or old.resolve() != last.resolve():
            shutil.rmtree(old, ignore_errors=True)
    for tmp in root.glob(".tmp-*"):
        if tmp.is_dir() and not tmp.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)


def latest(root: Path) -> Path | None:
    link = root / "last"
    if not link.exists():
        return None
    target = link.resolve()
    return target if (target / STATE).is_file() else None


def read_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / STATE).read_text())


def read_tensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    return load_file(str(path), device=str(device))


def read_torch(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def recipe_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two resolved recipes (allowed changes excluded)."""
    diffs: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for key in sorted(set(a) | set(b), key=str):
                walk(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{prefix}.{i}")
        elif a != b and not any(prefix == k or prefix.startswith(f"{k}.") for k in RESUMABLE_CHANGES):
            diffs.append(f"{prefix}: {a!r} in the checkpoint, {b!r} now")

    walk(saved, current, "")
    return diffs
