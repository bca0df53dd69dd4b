"""Which prompts an iteration trains on: whole groups, epoch-wise shuffled, split across processes."""

from __future__ import annotations

import attrs
import torch

from fgrpo.core.seeding import generator


@attrs.define
class PromptSchedule:
    """Iteration ``it`` takes global prompt slots it·P ... it·P + P − 1 of an endless sequence of
    shuffled epochs; process ``rank`` of ``world`` takes a contiguous block of P / world slots.

    Each prompt is a whole group: all G samples of a prompt live on one process, so group
    statistics never need samples from another process. The position is a pure function of the
    iteration number (the "data position" a checkpoint records is the iteration).
    """

    prompts: list[str]
    per_iteration: int
    seed: int
    rank: int = 0
    world: int = 1

    def __attrs_post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("prompts: the training split is empty")
        if self.per_iteration % self.world:
            raise ValueError(
                f"train.prompts_per_iteration: got {self.per_iteration}; with {self.world} processes "
                f"it must be a multiple of {self.world} (each process takes whole prompt groups)"
            )

    def _order(self, epoch: int) -> list[int]:
        g = generator(self.seed, "prompt-order", epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def global_slots(self, iteration: int) -> list[int]:
        start = iteration * self.per_iteration
        return list(range(start, start + self.per_iteration))

    def local_slots(self, iteration: int) -> list[int]:
        per_rank = self.per_iteration // self.world
        slots = self.global_slots(iteration)
        return slots[self.rank * per_rank : (self.rank + 1) * per_rank]

    def prompt(self, slot: int) -> str:
        n = len(self.prompts)
        return self.prompts[self._order(slot // n)[slot % n]]

    def local(self, iteration: int) -> list[tuple[int, str]]:
        return [(slot, self.prompt(slot)) for slot in self.local_slots(iteration)]
