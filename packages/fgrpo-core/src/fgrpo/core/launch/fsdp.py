"""FSDP2 (accelerate's FSDP plugin, ``fsdp_version: 2``): the policy's ``trainable_module`` (the
transformer: the module that holds every trainable parameter and that the policy calls for each
forward) is sharded in place with the optimizer by ``accelerator.prepare``. accelerate makes
every transformer block (the module's ``_no_split_modules``, or the classes the config names)
and then the whole module an FSDP unit; parameters become DTensor shards, each forward
all-gathers a unit's parameters and backward reduce-scatters its gradients, averaged over the
processes.

So every forward (rollout, reference, update, evaluation: evaluation runs on every process) and
every backward involves every process: a process with fewer passes pads them. Checkpoints hold
whole tensors (every process takes part in gathering them, the main process writes), the same
files as a data-parallel run; loading keeps each process's shard.

A policy may load the network it shards without its weights (the diffusers backbones do under
FSDP2: :mod:`fgrpo.models.sharded_load`): its ``shard_loading()`` context, around the sharding
in :func:`shard_policy`, reads each process's shard once ``fully_shard`` has cut the module, and
no process ever holds the network whole.

accelerate 1.15 sets FSDP up only on accelerators: on a machine without one, an FSDP launch is
completed over gloo (:func:`enable_on_cpu`), so that the code paths run (slowly) on a laptop or
in CI.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any, ClassVar, TypeVar

import attrs
import torch

from fgrpo.core.launch.common import (
    Processes,
    broadcast_parameters,
    passes_behind,
    refuse,
    scaled_backward,
    trainable_module,
    trainable_of,
    unscale_clip_step,
)

T = TypeVar("T")


@attrs.define
class FSDP2(Processes):
    """The weights, gradients and optimizer state split over the processes (DTensor shards)."""

    sharded: ClassVar[bool] = True
    sharded_weights: ClassVar[bool] = True
    description: ClassVar[str] = "sharded (FSDP2)"
    loads_shards: ClassVar[bool] = True  # through the policy's shard_loading() (shard_policy)

    def prepare(self, policy: Any, optimizer: torch.optim.Optimizer, train: Any) -> list[torch.nn.Parameter]:
        return shard_policy(self.accelerator, policy, optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        scaled_backward(self.accelerator, loss)

    def step(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_grad_norm: float
    ) -> torch.Tensor | None:
        zero_missing_gradients(params)
        return unscale_clip_step(self.accelerator, optimizer, params, max_grad_norm)  # averaged in backward

    def missing_forwards(self, passes: int) -> int:
        return passes_behind(self.accelerator, passes)  # each forward all-gathers the weights

    def missing_backwards(self, passes: int) -> int:
        return passes_behind(self.accelerator, passes)

    def gathered(self, collect: Callable[[], T]) -> T | None:
        value = collect()
        return value if self.is_main else None


def zero_missing_gradients(params: list[torch.nn.Parameter]) -> None:
    """A zero gradient for every parameter no pass of the step reached on any process (Wan 2.2's
    expert without trained steps in it): data parallel's average gives it zeros, so AdamW moves it
    by its momentum and weight decay; without this, AdamW would skip it here."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


# --- set-up -------------------------------------------------------------------------------------


def launched(env: Mapping[str, str] | None = None) -> bool:
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


def shard_policy(accelerator: Any, policy: Any, optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """Shard the policy's ``trainable_module`` with the optimizer through ``accelerator.prepare``
    (in place: the policy keeps calling the same module); returns the trainable parameters, now
    DTensor shards, in the optimizer's order."""
    module = trainable_module(policy, optimizer)
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version != 2:
        raise refuse(
            "accelerate",
            f"fsdp_version {plugin.fsdp_version} is not supported: fgrpo shards with FSDP2 (fully_shard keeps the "
            f"policy's "
            "module in place); set fsdp_version: 2 (recipes/accelerate/fsdp-lora.yaml, fsdp-full.yaml)",
        )
    _as_data_parallel(plugin)
    loading = getattr(policy, "shard_loading", None)  # a policy that reads its shards once sharded
    with loading() if callable(loading) else nullcontext():
        # process 0's initial weights on every process; the weights still to read (meta) are the
        # files' on every process
        broadcast_parameters(accelerator, [p for p in trainable_of(optimizer) if not p.is_meta])
        prepared, _ = accelerator.prepare(module, optimizer)
    if prepared is not module:  # the policy would keep calling the unsharded module
        raise RuntimeError("accelerate replaced the policy's trainable_module instead of sharding it in place")
    params = trainable_of(optimizer)
    if {id(p) for p in params} != {id(p) for p in policy.trainable_parameters() if p.requires_grad}:
        raise RuntimeError("after sharding, the optimizer's parameters are not the policy's trainable parameters")
    return params


def _as_data_parallel(plugin: Any) -> None:
    """Mixed precision with the numerics of a data-parallel run: weights all-gathered in their own
    dtype (accelerate keeps trainable ones in float32) and computed under the run's autocast,
    gradients reduced in float32. accelerate's bf16 policy would gather bf16 copies of the weights
    and reduce in bf16: then a forward's rounding depends on its batch size, and the first ratio
    is 1 only when the update's forward passes hold the rollout's batches."""
    policy = plugin.mixed_precision_policy
    if policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=policy.cast_forward_inputs
    )
