"""ZeRO-3 without a whole network in any process: the policy's stand-ins (weights not yet read:
:mod:`fgrpo.models.sharded_load`) become DeepSpeed partitioned parameters before
``accelerator.prepare``, each holding only this process's flat partition, read from the
safetensors files; DeepSpeed then takes the module as built partitioned, as it takes one built
under ``deepspeed.zero.Init`` (it neither broadcasts nor re-partitions it).

What DeepSpeed does to a partitioned parameter it makes itself (``Init._zero_init_param``: a
broadcast of the whole weight from process 0, then ``_partition_param``: the weight flattened and
padded to a multiple of the processes, process r keeping elements ``r*n:(r+1)*n``) is done here
from the files, without the whole weight: the same layout, the same devices (the partitions of
weights kept whole, ``ds_persist``, on the accelerator; the others on ``offload_param``'s device),
and the values the whole load would give, cast to the engine's dtype as the engine casts a module
it did not see partitioned (bf16 / fp16 mode: every floating weight). Because the engine skips that
cast and its ``module.to(device)`` for a module that arrives partitioned, :meth:`Partitions.finish`
does them for what is not partitioned yet (the LoRA matrices, the buffers).

Relies on DeepSpeed 0.19's ``Init`` internals (``_convert_to_deepspeed_param``, ``_aligned_size``,
``_partition_rank``, the ``ds_tensor`` attributes): fgrpo-core pins ``deepspeed<0.20``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

#: the dtypes DeepSpeed's engine casts to its bf16 / fp16 compute dtype (deepspeed/runtime/engine.py)
CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def engine_dtype(config: dict[str, Any]) -> torch.dtype | None:
    """The dtype DeepSpeed's engine casts every floating weight to (its fp16 / bf16 mode), or None."""

    def enabled(key: str) -> bool:
        return str((config.get(key) or {}).get("enabled", False)).lower() == "true"

    if enabled("fp16"):
        return torch.float16
    if enabled("bf16") or enabled("bfloat16"):
        return torch.bfloat16
    return None


def init_config(config: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config for ``deepspeed.zero.Init`` before accelerate has filled its ``auto``
    batch values (as accelerate's ``set_deepspeed_weakref`` does for transformers' zero.Init)."""
    found = dict(config)
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
        if found.get(key, "auto") == "auto":
            found[key] = 1
    if found.get("train_batch_size") == "auto":
        del found["train_batch_size"]
    if found.get("gradient_clipping") == "auto":
        del found["gradient_clipping"]
    return found


@attrs.define
class Partitions:
    """Makes stand-ins partitioned parameters (``place``), then completes what the engine skips
    (``finish``). ``placed``: how many weights it partitioned."""

    config: dict[str, Any]  # the launch's DeepSpeed config
    placed: int = 0
    _init: Any = None

    @property
    def dtype(self) -> torch.dtype | None:
        return engine_dtype(self.config)

    @property
    def init(self) -> Any:
        """A ``deepspeed.zero.Init``, never entered: its conversion of one parameter (made when a
        first stand-in is placed; DeepSpeed's engine converts the module's other parameters with it)."""
        if self._init is None:
            import deepspeed

            self._init = deepspeed.zero.Init(config_dict_or_path=init_config(self.config))
        return self._init

    def __call__(self, param: Any, read: Callable[[int, int], torch.Tensor]) -> None:
        """``param`` (a stand-in: the right shape, no memory) as a partitioned parameter holding this
        process's partition, whose elements ``read(start, stop)`` gives in ``param``'s dtype."""
        from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

        init, weight = self.init, param
        dtype = self.dtype if self.dtype is not None and param.dtype in CASTABLE else param.dtype
        init._convert_to_deepspeed_param(weight)  # its shape, numel, process group, id, methods
        processes = init._partition_world_size(weight)
        size = init._aligned_size(weight) // processes
        start = size * init._partition_rank(weight)
        stop = min(start + size, weight.ds_numel)
        device = init.local_device if weight.ds_persist else init.remote_device
        part: Any = torch.zeros(size, dtype=dtype, device=device)  # the padding: zeros
        if stop > start:
            part[: stop - start].copy_(read(start, stop).to(dtype))  # the whole load's value, cast as the engine
        if init.pin_memory and part.device.type == "cpu":
            from deepspeed.accelerator import get_accelerator

            part = get_accelerator().pin_memory(part)
        part.requires_grad = False
        part.ds_numel = size
        part.status = PartitionedParamStatus.AVAILABLE
        part.final_location = None
        weight.ds_tensor = part
        weight.ds_numel_aligned = size * processes
        weight.data = torch.empty(0, dtype=dtype, device=init.local_device)
        weight.partition()  # already partitioned: marks it not available, as DeepSpeed's own
        self.placed += 1

    def finish(self, module: torch.nn.Module) -> None:
        """What the engine does to a module it partitions itself but skips for one that arrives
        partitioned: the other weights cast to its compute dtype, the buffers moved to its device."""
        if not self.placed:
            return
        from deepspeed.runtime.zero.partition_parameters import is_zero_param

        device = self.init.local_device
        with torch.no_grad():
            for p in module.parameters():
                if is_zero_param(p):
                    continue
                cast = self.dtype if self.dtype is not None and p.dtype in CASTABLE else p.dtype
                p.data = p.data.to(device=device, dtype=cast)
            for owner in module.modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        owner._buffers[name] = buffer.to(device)
