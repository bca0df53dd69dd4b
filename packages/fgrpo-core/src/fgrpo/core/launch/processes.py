"""Data parallel, over one process or several: every process keeps the whole network and
optimizer and rolls out its own prompt groups; gradients are averaged by one all-reduce per
optimizer step (a Policy need not be one nn.Module, so DDP's forward hooks are not used).

Under context parallelism (a policy whose ``context_parallel_size`` U is > 1) the U processes of a
group roll out and train on the same samples, each holding 1/U of every sample's tokens: each
one's gradient is its tokens' part, so the group's gradient is their sum, and the step averages
those sums over the groups (the all-reduce's mean over every process, times U)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import attrs
import torch

from fgrpo.core.launch.common import (
    Processes,
    broadcast_parameters,
    context_parallel_size,
    scaled_backward,
    trainable_of,
    unscale_clip_step,
)

T = TypeVar("T")


@attrs.define
class DataParallel(Processes):
    """The same initial weights on every process (broadcast from the main one), gradients averaged
    before every optimizer step, the main process alone writing checkpoints. With one process
    nothing is shared, averaged or padded."""

    sharded: ClassVar[bool] = False
    sharded_weights: ClassVar[bool] = False
    description: ClassVar[str] = ""

    def prepare(self, policy: Any, optimizer: torch.optim.Optimizer, train: Any) -> list[torch.nn.Parameter]:
        params = trainable_of(optimizer)
        self.replicas = context_parallel_size(policy)
        broadcast_parameters(self.accelerator, params)
        return params

    def backward(self, loss: torch.Tensor) -> None:
        scaled_backward(self.accelerator, loss)

    def step(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_grad_norm: float
    ) -> torch.Tensor | None:
        if self.processes > 1:
            average_gradients(self.accelerator, params, scale=self.replicas)
        return unscale_clip_step(self.accelerator, optimizer, params, max_grad_norm)

    def missing_forwards(self, passes: int) -> int:
        return 0  # the weights are whole on every process: a forward involves no other

    def missing_backwards(self, passes: int) -> int:
        return 0  # gradients are averaged once per optimizer step, not in every backward

    def gathered(self, collect: Callable[[], T]) -> T | None:
        return collect() if self.is_main else None


def average_gradients(accelerator: Any, params: Sequence[torch.nn.Parameter], scale: int = 1) -> None:
    """Average gradients over processes: one all-reduce of a flat buffer (times ``scale``: the
    processes of a context-parallel group, whose partial gradients add up)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = accelerator.reduce(torch.cat([g.reshape(-1) for g in grads]), reduction="mean")
    if scale != 1:
        flat = flat * scale
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
