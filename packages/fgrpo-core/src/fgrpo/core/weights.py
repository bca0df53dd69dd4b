"""Whether the weights a run hands over do anything: an EMA that never received an update (its
weights are the initial ones), an EMA identical to the raw weights, a LoRA whose every up
projection is zero (loaded into a pipeline it changes nothing).

A run checks at its end and ``fgrpo export`` checks what it wrote: each problem is one warning
line that says what to do instead (``--no-ema``, a smaller ``train.ema_every``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: state.json's key for :func:`ema_summary`
STATE_KEY = "ema"
#: the LoRA weights that are zero at initialisation (peft's lora_B, kohya's lora_up): a LoRA whose
#: every one of these is zero adds nothing to the base model
UP_PROJECTIONS = ("lora_B", "lora_up", "lora.up")


def ema_updates(optimizer_steps: int, every: int) -> int:
    """How many times the EMA moved: once every ``train.ema_every`` optimizer steps."""
    return optimizer_steps // max(1, every)


def ema_summary(ema: Any, optimizer_steps: int, every: int) -> dict[str, Any]:
    """What a checkpoint records about its EMA: its updates and its largest difference to the raw
    weights. In a sharded run every process must call this (whole tensors are gathered)."""
    from fgrpo.core.launch.shards import full

    difference = 0.0
    for shadow, param in zip(ema.shadow, ema.params, strict=True):
        d = (
            (full(shadow, like=param).float() - full(param).detach().float()).abs().max().item()
            if shadow.numel()
            else 0.0
        )
        difference = max(difference, d)
    return {
        "updates": ema_updates(optimizer_steps, every),
        "optimizer_steps": optimizer_steps,
        "max_abs_difference": difference,
    }


def ema_warnings(summary: Mapping[str, Any] | None, every: int) -> list[str]:
    """The lines to show for an EMA :func:`ema_summary` (none for an EMA that works)."""
    if not summary:
        return []
    steps, updates = int(summary.get("optimizer_steps", 0)), int(summary.get("updates", 0))
    if steps > 0 and updates == 0:
        return [
            f"the EMA received no update in {steps} optimizer step(s) (train.ema_every: {every}): its weights are the "
            "initial ones, so evaluation, the checkpoints' export/ and `fgrpo export` show the base model; "
            "`fgrpo export --no-ema` writes the trained weights and `fgrpo sample --no-ema` draws from them "
            f"(or set train.ema_every <= {steps})"
        ]
    if steps > 0 and summary.get("max_abs_difference") == 0.0:
        return [
            f"the EMA equals the raw trained weights exactly after {updates} update(s) of {steps} optimizer step(s): "
            "it averages nothing (check train.ema_decay)"
        ]
    return []


def summary_of_checkpoint(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's :func:`ema_summary` (older checkpoints: the updates from its optimizer steps);
    None when its run kept no EMA."""
    train = (state.get("recipe") or {}).get("train") or {}
    if not train.get("ema_decay"):
        return None
    saved = state.get(STATE_KEY)
    if isinstance(saved, Mapping):
        return dict(saved)
    steps = int(state.get("optimizer_steps", 0))
    return {"updates": ema_updates(steps, int(train.get("ema_every", 1))), "optimizer_steps": steps}


def empty_lora_files(folder: Path) -> list[Path]:
    """The LoRA files of an export ``folder`` (``*.safetensors`` with up-projection weights) whose
    every up projection is exactly zero."""
    import torch

    from fgrpo.core import runread

    empty = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        if path.is_symlink() or not path.is_file():  # only what the export wrote, never through a link
            continue
        try:
            tensors = runread.read_safetensors(path, what=str(path.parent))
        except runread.Unreadable:  # not ours to judge: a file that is not a readable LoRA is left alone
            continue
        ups = [v for k, v in tensors.items() if any(f".{u}." in f".{k}" for u in UP_PROJECTIONS)]
        if ups and all(not torch.any(v) for v in ups):
            empty.append(path)
    return empty


def lora_warnings(folder: Path) -> list[str]:
    files = empty_lora_files(folder)
    if not files:
        return []
    names = ", ".join(p.name for p in files)
    return [
        f"the exported LoRA in {folder} is empty: every up-projection weight (lora_B) of {names} is 0, so a pipeline "
        "that loads it gives exactly the base model's output"
    ]


def checkpoint_warnings(checkpoint: Path) -> list[str]:
    """What is wrong with the weights a checkpoint hands over: an EMA that never moved or equals
    the raw weights, an ``export/`` LoRA that changes nothing (none for a missing checkpoint)."""
    from fgrpo.core import runread

    try:
        state = runread.read_state(Path(checkpoint) / "state.json", what=str(Path(checkpoint) / "state.json"))
        every = state["recipe"]["train"].get("ema_every", 1)
    except (runread.Unreadable, KeyError, TypeError, AttributeError):
        return []
    return ema_warnings(summary_of_checkpoint(state), every) + lora_warnings(Path(checkpoint) / "export")
