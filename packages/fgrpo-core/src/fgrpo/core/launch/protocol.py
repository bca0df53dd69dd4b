"""What every launch kind does for a run: the one object (``run.learner.launch``) that the update, the
checkpoints and evaluation call, so that none of them branches on the kind of launch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

T = TypeVar("T")


@runtime_checkable
class Launch(Protocol):
    """How a run's processes share its work: one class per launch kind (:mod:`.processes`,
    :mod:`.fsdp`, :mod:`.deepspeed`), chosen by :func:`fgrpo.core.launch.of`.

    The update clears the gradients with :meth:`zero_grad`, calls :meth:`backward` for every pass
    (any loss: it knows nothing of what the pass computed), pads with :meth:`missing_backwards` (or
    :meth:`missing_forwards` for passes without backward) zero-weighted passes so that every process
    makes as many collective passes, and ends each optimizer step with :meth:`step`. Checkpoints
    gather what they write with :meth:`gathered` and :meth:`optimizer_state`, and load with
    :meth:`load_optimizer_state`.
    """

    accelerator: Any

    # read-only: properties here, so that the kinds' class attributes satisfy them
    @property
    def sharded(self) -> bool:
        """The training state is split over the processes: every backward and every checkpoint
        involves every process."""
        ...

    @property
    def sharded_weights(self) -> bool:
        """The weights themselves are split: every forward involves every process."""
        ...

    @property
    def description(self) -> str:
        """How the start-up line names the kind beyond the process count ("" when unsharded)."""
        ...

    @staticmethod
    def check(accelerator: Any) -> None:
        """Refuse, when the Accelerator is made, launcher settings the kind does not run."""
        ...

    @property
    def processes(self) -> int: ...

    @property
    def replicas(self) -> int:
        """Processes that hold the same samples (a context-parallel group; 1 without)."""
        ...

    @property
    def data_processes(self) -> int:
        """How many different shares of the batch the processes hold (processes / replicas)."""
        ...

    @property
    def data_rank(self) -> int:
        """Which share of the batch this process holds (its context-parallel group's index)."""
        ...

    def one_per_share(self, gathered: torch.Tensor) -> torch.Tensor:
        """A gather over every process with the replicas of each share left out."""
        ...

    @property
    def is_main(self) -> bool: ...

    def prepare(self, policy: Any, optimizer: torch.optim.Optimizer, train: Any) -> list[torch.nn.Parameter]:
        """The run's trainable parameters, in the optimizer's order, once the kind has set the
        policy and optimizer up (the same initial weights on every process; sharded, wrapped)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one pass (the loss already weighted by the pass's share of the step)."""
        ...

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear the gradients before an optimizer step's first pass."""
        ...

    def step(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_grad_norm: float
    ) -> torch.Tensor | None:
        """One optimizer step on the gradients accumulated since the last: averaged over the
        processes, unscaled (fp16), clipped to ``max_grad_norm`` (0: no clipping); the gradient
        norm before clipping (None without clipping)."""
        ...

    def missing_forwards(self, passes: int) -> int:
        """How many forwards this process adds so that every process makes as many as the busiest
        (0 unless forwards involve every process). A collective where it is not 0: every process
        asks at the same point, before its first pass."""
        ...

    def missing_backwards(self, passes: int) -> int:
        """How many zero-weighted forward/backward passes this process adds so that every process
        makes as many as the busiest (0 unless backward passes involve every process). A
        collective where it is not 0: every process asks at the same point, before its first pass."""
        ...

    def gathered(self, collect: Callable[[], T]) -> T | None:
        """``collect()`` (what a checkpoint writes) on the processes that must take part in
        gathering it; its value on the main process, None on the others."""
        ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> dict[str, Any]:
        """The optimizer's state with whole tensors, in ``torch.optim`` format: the same file for
        every kind, so any kind resumes from it (collective in a sharded run)."""
        ...

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: Mapping[str, Any]
    ) -> None:
        """Load :meth:`optimizer_state`'s dict, of any kind of run (after the weights are loaded)."""
        ...

    def whole_weights(
        self, params: Sequence[torch.nn.Parameter], modify: bool = False
    ) -> AbstractContextManager[None]:
        """Inside, ``params`` hold their whole values for code that reads them outside a forward
        (a policy's state dicts; collective where the weights are partitioned: ZeRO-3); with
        ``modify``, what is written into them inside (the same on every process) is kept."""
        ...

    def share(self, value: Any) -> Any:
        """The main process's ``value`` on every process."""
        ...

    def largest(self, value: int) -> int:
        """The largest of the processes' ``value`` on every process (what any one of them saw)."""
        ...

    def wait(self) -> None:
        """Wait until every process gets here."""
        ...
