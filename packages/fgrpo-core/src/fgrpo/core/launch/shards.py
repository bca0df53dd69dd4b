"""Whole tensors and shards: DTensor shards (FSDP2) gathered where a file is written and cut again
where one is read, so that a checkpoint of any launch kind holds whole tensors.

Every function here is a no-op on ordinary tensors: callers (the EMA, a policy's state dicts, the
optimizer state of the unsharded kinds) need not know the launch kind.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support
        return None
    return DTensor


def is_sharded_tensor(t: Any) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def full(t: Any) -> Any:
    """The whole tensor of a DTensor shard (every process must call: an all-gather); other values
    as they are."""
    return t.full_tensor() if is_sharded_tensor(t) else t


def full_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor gathered (in the mapping's order: the same on every process)."""
    return {k: full(v) for k, v in state.items()}


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) as ``like`` holds it: this process's shard when ``like`` is a
    DTensor (no communication: every process has read the whole tensor), else ``value``."""
    if not is_sharded_tensor(like):
        return value
    from torch.distributed.tensor import DTensor, distribute_tensor

    assert isinstance(like, DTensor)  # is_sharded_tensor
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def whole_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with whole tensors (a sharded run's processes must all call this)."""
    state = optimizer.state_dict()
    return {**state, "state": {i: full_state(per_param) for i, per_param in sorted(state["state"].items())}}


def load_whole_optimizer_state(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: Mapping[str, Any]
) -> None:
    """Load :func:`whole_optimizer_state`'s dict; a parameter held as a DTensor keeps its shard of
    each per-parameter tensor."""
    per_param = dict(state["state"])
    for i, values in per_param.items():
        param = params[int(i)] if int(i) < len(params) else None
        if param is None or not is_sharded_tensor(param):
            continue
        per_param[i] = {
            k: shard_like(v, param) if isinstance(v, torch.Tensor) and v.shape == param.shape else v
            for k, v in values.items()
        }
    optimizer.load_state_dict({**state, "state": per_param})
