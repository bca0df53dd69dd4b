"""What several launch kinds share: autograd's backward and ``torch.optim`` step (every kind but
DeepSpeed), and the collectives of a run with several processes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.launch.shards import full, load_whole_optimizer_state, whole_optimizer_state


@attrs.define
class Processes:
    """What every kind reads the same way from accelerate's processes (the kinds build on it)."""

    accelerator: Any
    #: a policy may load the network this kind shards shard by shard: built without weights, each
    #: process reading its own shard once ``prepare`` has cut it (fgrpo.models.load_plan)
    loads_shards: ClassVar[bool] = False
    #: processes that hold the same samples: a context-parallel group, which splits each sample's
    #: tokens over its processes (the policy's ``context_parallel_size``, set by ``prepare``); 1: none
    replicas: int = 1

    @staticmethod
    def check(accelerator: Any) -> None:
        """What of the launcher's settings this kind refuses before the run is built (nothing here)."""

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def data_processes(self) -> int:
        """How many different shares of the batch the processes hold (processes / replicas)."""
        return self.processes // self.replicas

    @property
    def data_rank(self) -> int:
        """Which share of the batch this process holds (its context-parallel group's index)."""
        return self.accelerator.process_index // self.replicas

    def one_per_share(self, gathered: torch.Tensor) -> torch.Tensor:
        """``gathered`` (every process's equally long block, in process order) with one block per
        share of the batch: the replicas of a context-parallel group hold the same samples."""
        if self.replicas == 1:
            return gathered
        return gathered.unflatten(0, (self.processes, -1))[:: self.replicas].flatten(0, 1)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def share(self, value: Any) -> Any:
        """The main process's ``value`` on every process."""
        if self.processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        box = [value]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def largest(self, value: int) -> int:
        if self.processes == 1:
            return value
        acc = self.accelerator
        return int(acc.gather(torch.tensor([value], device=acc.device)).max())

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def optimizer_state(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[str, Any]:
        """The optimizer's state with whole tensors (torch's optimizer: every kind but DeepSpeed)."""
        return whole_optimizer_state(optimizer)

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: Mapping[str, Any]
    ) -> None:
        load_whole_optimizer_state(optimizer, params, state)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    @contextmanager
    def whole_weights(self, params: Sequence[torch.nn.Parameter], modify: bool = False) -> Iterator[None]:
        """Nothing to gather: every kind but ZeRO-3 keeps each weight whole or as a DTensor shard
        that state dicts gather themselves (:mod:`.shards`)."""
        yield


def scaled_backward(accelerator: Any, loss: torch.Tensor) -> None:
    """Autograd's backward, with accelerate's loss scaling (fp16)."""
    scaler = getattr(accelerator, "scaler", None)
    (scaler.scale(loss) if scaler is not None else loss).backward()


def unscale_clip_step(
    accelerator: Any, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], max_grad_norm: float
) -> torch.Tensor | None:
    """The optimizer step on gradients already averaged over the processes: unscaled (fp16; after
    the average, so every process sees the same inf/nan), clipped; the norm before clipping."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = None
    if max_grad_norm > 0:
        norm = full(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)).detach()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return norm


def broadcast_parameters(accelerator: Any, params: Sequence[torch.nn.Parameter]) -> None:
    """The main process's initial weights on every process."""
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)


def passes_behind(accelerator: Any, passes: int) -> int:
    """How many passes this process makes fewer than the busiest one (a gather over the processes)."""
    counts = accelerator.gather(torch.tensor([passes], device=accelerator.device))
    return int(counts.max()) - passes


def context_parallel_size(policy: Any) -> int:
    """How many processes split each of ``policy``'s samples (its ``context_parallel_size``; 1 when it
    names none)."""
    return int(getattr(policy, "context_parallel_size", 1) or 1)


def trainable_of(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The optimizer's parameters, in its order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def refuse(key: str, message: str) -> RecipeError:
    return RecipeError([ConfigError(key, message)])


def trainable_module(policy: Any, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    """The module a sharded kind splits or wraps: the policy's ``trainable_module``, which must hold
    every parameter the optimizer trains."""
    module = getattr(policy, "trainable_module", None)
    name = type(policy).__name__
    if context_parallel_size(policy) > 1:
        raise refuse(
            "model.context_parallel",
            "runs under a data-parallel launch only (its groups sum their partial gradients in the data-parallel "
            "all-reduce); launch it with recipes/accelerate/ddp.yaml or set model.context_parallel: null",
        )
    if not isinstance(module, torch.nn.Module):
        raise refuse(
            "model",
            f"{name} cannot be sharded: it names no trainable_module (the network FSDP or DeepSpeed splits over the "
            "processes); launch it data parallel (recipes/accelerate/ddp.yaml)",
        )
    owned = {id(p) for p in module.parameters()}
    if any(id(p) not in owned for p in trainable_of(optimizer)):
        raise refuse(
            "model",
            f"{name} trains parameters outside its trainable_module, which cannot be sharded; launch it data parallel",
        )
    return module
