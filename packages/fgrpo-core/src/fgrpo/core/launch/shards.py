"""Whole tensors and shards: DTensor shards (FSDP2) and DeepSpeed ZeRO-3 partitions gathered where
a file is written and cut again where one is read, so that a checkpoint of any launch kind holds
whole tensors.

A ZeRO-3 parameter's own data is empty between forwards: what this process holds of it is
:func:`local` (its flat partition ``ds_tensor``, padded to the same size on every process), and a
tensor kept beside it (the EMA's) is a partition of the same layout, gathered with
``full(t, like=param)``.

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


# A ZeRO-3 parameter carries DeepSpeed's ds_tensor / ds_numel / ds_shape (deepspeed is untyped): the
# functions that read them take Any.
def is_partitioned(p: Any) -> bool:
    """Whether ``p`` is a parameter DeepSpeed ZeRO-3 split over the processes."""
    return isinstance(p, torch.Tensor) and hasattr(p, "ds_tensor") and hasattr(p, "ds_shape")


def local(p: Any) -> torch.Tensor:
    """What this process holds of ``p``: a ZeRO-3 parameter's flat partition, else ``p`` itself
    (a DTensor is its own shard)."""
    return p.ds_tensor if is_partitioned(p) else p


def full(t: Any, like: Any = None) -> Any:
    """The whole tensor of a DTensor shard, of a ZeRO-3 parameter, or of a partition ``t`` of the
    ZeRO-3 parameter ``like`` (every process must call: an all-gather); other values as they are."""
    if is_partitioned(t) and like is None:
        t, like = t.ds_tensor, t
    if like is not None and is_partitioned(like):
        return _gathered_partitions(t, like)
    return t.full_tensor() if is_sharded_tensor(t) else t


def _gathered_partitions(part: torch.Tensor, param: Any) -> torch.Tensor:
    import torch.distributed as dist

    group = getattr(param, "ds_process_group", None)
    device = _communication_device(part)
    pieces = [torch.empty_like(part, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, part.detach().to(device), group=group)
    return torch.cat(pieces)[: param.ds_numel].view(param.ds_shape).to(part.device)


def _communication_device(t: torch.Tensor) -> torch.device:
    """Where a collective takes ``t``: the process's accelerator (NCCL gathers no CPU tensors;
    ZeRO-3 keeps offloaded partitions on the CPU), or the CPU on a machine without one."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _partition_of(value: torch.Tensor, param: Any) -> torch.Tensor:
    """This process's partition of the whole tensor ``value`` of the ZeRO-3 parameter ``param``."""
    import torch.distributed as dist

    size = param.ds_tensor.numel()
    start = size * dist.get_rank(getattr(param, "ds_process_group", None))
    flat = value.reshape(-1)[start : start + size]
    part = torch.zeros(size, dtype=value.dtype, device=param.ds_tensor.device)
    part[: flat.numel()] = flat
    return part


def write_local(p: Any, value: torch.Tensor) -> None:
    """Set what this process holds of ``p`` to ``value`` (a :func:`local` of the same layout); a
    ZeRO-3 parameter whose whole data is held between forwards too (DeepSpeed keeps small ones,
    under ``stage3_param_persistence_threshold``) gets it gathered again (collective)."""
    if not is_partitioned(p):
        p.copy_(value)
        return
    p.ds_tensor.copy_(value)
    if p.data.numel() == p.ds_numel:  # persistent: its whole data outlives the forwards
        p.data.copy_(_gathered_partitions(p.ds_tensor, p))


def full_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor gathered (in the mapping's order: the same on every process)."""
    return {k: full(v) for k, v in state.items()}


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) as ``like`` holds it: this process's shard when ``like`` is a
    DTensor, its partition when ``like`` is a ZeRO-3 parameter (no communication: every process
    has read the whole tensor), else ``value``."""
    if is_partitioned(like):
        return _partition_of(value, like)
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
