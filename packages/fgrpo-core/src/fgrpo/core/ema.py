"""Exponential moving average of the trainable weights (used for evaluation and sampling)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from fgrpo.core.launch.shards import full, local, shard_like, write_local


class EMA:
    """The average is kept in at least float32: an average of bf16 weights (DeepSpeed's bf16 mode,
    bf16 full fine-tuning) kept in bf16 would round away most of each small update. In a sharded
    run each process averages what it holds of each weight (an FSDP shard, a ZeRO-3 partition)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float):
        self.params = list(params)
        self.decay = decay
        self.shadow = [
            local(p).detach().to(torch.promote_types(p.dtype, torch.float32), copy=True) for p in self.params
        ]

    def warmup_decay(self, steps: int) -> float:
        """flow_grpo's warm-up: min((1 + n) / (10 + n), decay) after n optimizer steps, so the
        average follows the weights closely early in a run instead of the initial weights."""
        return min((1 + steps) / (10 + steps), self.decay)

    @staticmethod
    def due(optimizer_steps: int, every: int, rule: str = "step") -> bool:
        """Whether the average moves after the ``optimizer_steps``-th optimizer step: every
        ``every``-th (rule ``step``), or one step earlier as flow_grpo's ``(global_step + 1) %
        update_step_interval == 0`` (rule ``flow_grpo``)."""
        return (optimizer_steps + (rule == "flow_grpo")) % every == 0

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """shadow <- decay * shadow + (1 - decay) * weights (``decay`` defaults to the EMA's)."""
        weight = 1.0 - (self.decay if decay is None else decay)
        for s, p in zip(self.shadow, self.params, strict=True):
            s.lerp_(local(p).detach().to(s.dtype), weight)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Evaluate with the EMA weights; the trained weights come back bit for bit."""
        backup = [local(p).detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow, strict=True):
                write_local(p, s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup, strict=True):
                    write_local(p, b)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors (in a sharded run every process must call this: shards are gathered)."""
        return {f"ema.{i}": full(s, like=p) for i, (s, p) in enumerate(zip(self.shadow, self.params, strict=True))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Whole tensors, as :meth:`state_dict` gives them (a sharded run keeps its shards)."""
        if len(state) != len(self.shadow):
            raise ValueError(f"EMA state has {len(state)} tensors, the policy {len(self.shadow)}")
        for i, (s, p) in enumerate(zip(self.shadow, self.params, strict=True)):
            s.copy_(shard_like(state[f"ema.{i}"], p))


def ema_weights(ema: EMA | None) -> AbstractContextManager[None]:
    """The weights evaluation, sampling and exports use: the EMA's swapped in while inside when the
    run keeps one (the trained weights come back bit for bit), else the trained weights."""
    return ema.swapped_in() if ema is not None else nullcontext()
