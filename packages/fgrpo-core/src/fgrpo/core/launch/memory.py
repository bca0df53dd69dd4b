"""The launch kinds as ``fgrpo memory`` and the formula estimate (``fgrpo.models.memory`` and
``fgrpo.models.memory_formula``) see them: which ones split what over the processes, and the
accelerate config a recipe's header names. What differs between the launch kinds lives in this
package (tests/test_layout.py)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

#: the formula's launch kinds and the shipped configs they stand for
FORMULA_LAUNCHES = ("ddp", "fsdp", "deepspeed-zero2", "deepspeed-zero3", "zero2-offload", "zero3-offload")
FORMULA_NOTES = {
    "ddp": "recipes/accelerate/ddp.yaml",
    "fsdp": "fsdp-lora.yaml / fsdp-full.yaml",
    "deepspeed-zero2": "deepspeed-zero2.yaml",
    "deepspeed-zero3": "deepspeed-zero3.yaml",
    "zero2-offload": "deepspeed-zero2-offload.yaml",
    "zero3-offload": "deepspeed-zero3-offload.yaml",
}
#: the formula's kinds whose transformer weights are split over the GPUs (one block gathered at a time)
SPLIT_WEIGHTS = ("fsdp", "deepspeed-zero3", "zero3-offload")
#: what ``fgrpo memory --launch`` takes, and the formula's kind of each
MEASURED = ("ddp", "fsdp", "zero2", "zero3")
FORMULA_KIND = {"ddp": "ddp", "fsdp": "fsdp", "zero2": "deepspeed-zero2", "zero3": "deepspeed-zero3"}
#: the accelerate config a recipe's header names (``--config_file recipes/accelerate/X.yaml``)
DECLARED = {
    "ddp": "ddp",
    "fsdp-lora": "fsdp",
    "fsdp-full": "fsdp",
    "deepspeed-zero2": "zero2",
    "deepspeed-zero3": "zero3",
}


def declared_launch(text: str) -> str | None:
    """The launch a recipe's text (its header) declares, as :data:`MEASURED` names it, or None."""
    found = re.search(r"recipes/accelerate/([a-z0-9-]+)\.yaml", text)
    return DECLARED.get(found.group(1)) if found else None


def shards_weights(launch: str) -> bool:
    """FSDP2 and ZeRO-3 split the trained transformer's weights over the processes."""
    return launch in ("fsdp", "zero3")


def sharding_note(launch: str, gpus: int) -> str:
    """What :func:`share` divides, in words (empty for data parallel, and for FSDP2, whose sharding
    ``fgrpo memory`` runs on a fake process group and measures)."""
    if launch in ("ddp", "fsdp"):
        return ""
    what = "gradients and AdamW state" + (
        ", transformer weights (+ one block gathered)" if shards_weights(launch) else ""
    )
    return f"{launch} sharding: the measured {what} / {gpus}"


def share(parts: dict[str, int], gpus: int, launch: str, weights: int, block: int) -> None:
    """A DeepSpeed launch's bytes per process from an unsharded measurement ``parts`` ({kind: bytes}):
    gradients and AdamW state split over the processes (ZeRO-2, ZeRO-3); with ZeRO-3 the trained
    transformer's ``weights`` too, one ``block`` gathered at a time. (FSDP2 is measured, not divided:
    ``fgrpo memory`` runs its sharding on a fake process group.)"""
    if launch == "ddp":
        return
    saved = 0
    for kind in ("Gradient", "Optstate"):
        if kind in parts:
            cut = parts[kind] - parts[kind] // gpus
            parts[kind] -= cut
            saved += cut
    if shards_weights(launch) and "Parameter" in parts:
        cut = max(weights - weights // gpus - block, 0)
        parts["Parameter"] -= cut
        saved += cut
    if saved:
        parts["Total"] = parts.get("Total", 0) - saved


# --- the launches fgrpo memory runs on a fake process group (FSDP2: fgrpo.core.launch.fake_fsdp) ---


def runs_sharding(launch: str) -> bool:
    """Whether ``fgrpo memory`` runs ``launch``'s own sharding (FSDP2) rather than dividing."""
    return launch == "fsdp"


@contextlib.contextmanager
def sharded_run(launch: str, gpus: int) -> Iterator[Any]:
    """Outside fake mode: the fake process group of ``gpus`` ranks that ``launch`` shards over, and its
    device mesh (None, and no group, for the other launches)."""
    if not runs_sharding(launch):
        yield None
        return
    from fgrpo.core.launch import fake_fsdp

    with fake_fsdp.fake_group(gpus) as mesh:
        yield mesh


def shard(mesh: Any, policy: Any, optimizer: Any, precision: str) -> list[Any]:
    """The launch's sharding of ``policy`` and ``optimizer`` on the fake group's ``mesh``."""
    from fgrpo.core.launch import fake_fsdp

    return fake_fsdp.shard(mesh, policy, optimizer, precision)


def sharded_tracker(restart: type, root: Any, optimizer: Any) -> Any:
    """The memory tracker of the sharded ``root`` module and its ``optimizer``, with ``restart``'s hooks."""
    from fgrpo.core.launch import fake_fsdp

    return fake_fsdp.tracker_class(restart)(root, optimizer)


def kind_name(name: str) -> str:
    """A memory kind of the sharded launch's tracker as ``fgrpo memory`` names it."""
    from fgrpo.core.launch import fake_fsdp

    return fake_fsdp.KINDS.get(name, name)


def sharding_on_meta(replaced: dict[int, Any]) -> Any:
    """Around the launch's sharding on meta tensors: the meta tensors it makes are not counted;
    ``replaced`` maps the id of each parameter the harness replaced by a meta one to its
    replacement (the optimizer still holds the old one)."""
    from fgrpo.core.launch import fake_fsdp

    return fake_fsdp.sharding_on_meta(replaced)


def untracked(t: Any) -> bool:
    from fgrpo.core.launch import fake_fsdp

    return fake_fsdp.untracked(t)
