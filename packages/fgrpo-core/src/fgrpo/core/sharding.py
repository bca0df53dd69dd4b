"""Sharded runs: the policy's network split over the processes by FSDP2 (accelerate's FSDP plugin).

A data-parallel run keeps the whole network on every process and averages the gradients itself
(``phases.sync_gradients``). A sharded run hands the policy's ``trainable_module`` (the
transformer: the module that holds every trainable parameter and that the policy calls for each
forward) to ``accelerator.prepare`` together with the optimizer. accelerate makes every transformer
block (the module's ``_no_split_modules``, or the classes the config names) and then the whole
module an FSDP unit: parameters become DTensor shards, each forward all-gathers a unit's
parameters and backward reduce-scatters its gradients, averaged over the processes. What follows
for the rest of fgrpo:

- every process runs the same sequence of forwards and backwards: rollout and evaluation run on
  every process, and the update pads a process that has fewer (sample, step) batches than another
  with zero-weighted passes (:func:`missing_passes`);
- whole tensors are gathered where a file is written (:func:`full`, :func:`full_optimizer_state`):
  every process takes part, the main process writes. A checkpoint holds whole tensors, the same
  files as a data-parallel run, so either kind of run resumes from it and ``fgrpo export`` and
  ``fgrpo sample`` read it as they read any other;
- loading keeps each process's shard of the whole tensors it reads (:func:`shard_like`).

accelerate 1.15 sets FSDP up only on accelerators; on a machine without one,
:func:`enable_on_cpu` completes the same set-up over gloo, so that the code path runs (slowly) on
a laptop or in CI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from fgrpo.core.config import ConfigError, RecipeError

FSDP = "FSDP"


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support
        return None
    return DTensor


def is_sharded_tensor(t: Any) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(t, kind)


def is_sharded(accelerator: Any) -> bool:
    """Whether the run's network is split over its processes (accelerate's FSDP)."""
    return str(accelerator.distributed_type).split(".")[-1] == FSDP


def launched_sharded(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``accelerate launch`` asked for FSDP (its config file or ``--use_fsdp``)."""
    env = os.environ if env is None else env
    return env.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def enable_on_cpu(accelerator: Any) -> None:
    """An FSDP launch on a machine without accelerators: accelerate 1.15 would run it as plain
    data parallel over gloo (it sets FSDP up only for accelerators); complete the set-up as
    accelerate does there: the FSDP plugin from the launcher's settings, with the run's mixed
    precision."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState does


def _refuse(key: str, message: str) -> RecipeError:
    return RecipeError([ConfigError(key, message)])


def shard_policy(accelerator: Any, policy: Any, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """Shard the policy's ``trainable_module`` with the optimizer through ``accelerator.prepare``
    (in place: the policy keeps calling the same module); returns the trainable parameters, now
    DTensor shards, in the optimizer's order."""
    module = getattr(policy, "trainable_module", None)
    name = type(policy).__name__
    if not isinstance(module, torch.nn.Module):
        raise _refuse(
            "model",
            f"{name} cannot be sharded: it names no trainable_module (the network FSDP splits over the processes); "
            "launch it data parallel (recipes/accelerate/ddp.yaml)",
        )
    trainable = [p for group in optimizer.param_groups for p in group["params"]]
    owned = {id(p) for p in module.parameters()}
    if any(id(p) not in owned for p in trainable):
        raise _refuse("model", f"{name} trains parameters outside its trainable_module, which FSDP cannot shard; launch it data parallel")
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise _refuse(
            "accelerate",
            f"fsdp_version {plugin.fsdp_version} is not supported: fgrpo shards with FSDP2 (fully_shard keeps the policy's "
            "module in place); set fsdp_version: 2 (recipes/accelerate/fsdp-lora.yaml, fsdp-full.yaml)",
        )
    _reduce_in_float32(plugin, trainable)
    prepared, _ = accelerator.prepare(module, optimizer)
    if prepared is not module:  # the policy would keep calling the unsharded module
        raise RuntimeError("accelerate replaced the policy's trainable_module instead of sharding it in place")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if {id(p) for p in params} != {id(p) for p in policy.trainable_parameters() if p.requires_grad}:
        raise RuntimeError("after sharding, the optimizer's parameters are not the policy's trainable parameters")
    return params


def _reduce_in_float32(plugin: Any, trainable: list[torch.nn.Parameter]) -> None:
    """Average float32 gradients in float32 (accelerate's bf16 policy would reduce them in bf16),
    as the data-parallel all-reduce does; the forward still computes in the mixed precision."""
    policy = plugin.mixed_precision_policy
    if policy is None or policy.reduce_dtype in (None, torch.float32):
        return
    if any(p.dtype != torch.float32 for p in trainable):
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=policy.param_dtype,
        reduce_dtype=torch.float32,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
    )


# --- whole tensors and shards ------------------------------------------------------------------


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
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with whole tensors: the file a data-parallel run writes."""
    state = optimizer.state_dict()
    return {
        **state,
        "state": {i: full_state(per_param) for i, per_param in sorted(state["state"].items())},
    }


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load :func:`full_optimizer_state`'s dict (or a data-parallel run's): the state of a sharded
    parameter is cut to this process's shard first."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
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


def missing_passes(accelerator: Any, passes: int) -> int:
    """How many zero-weighted forward/backward passes this process adds so that every process of a
    sharded run makes as many as the busiest (FSDP's collectives run in every pass)."""
    counts = accelerator.gather(torch.tensor([passes], device=accelerator.device))
    return int(counts.max()) - passes


__all__ = [
    "enable_on_cpu",
    "full",
    "full_optimizer_state",
    "full_state",
    "is_sharded",
    "is_sharded_tensor",
    "launched_sharded",
    "load_full_optimizer_state",
    "missing_passes",
    "shard_like",
    "shard_policy",
]
