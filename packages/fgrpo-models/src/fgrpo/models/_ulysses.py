"""The collectives of Ulysses context parallelism over one group of processes, differentiable:
a sample's token sequence is split in contiguous blocks (``torch.tensor_split`` sizes, so any
length), each process holds one block with every head; attention needs the whole sequence, so an
all-to-all trades (my tokens, all heads) for (all tokens, my heads) and back. Each exchange's
backward is the inverse exchange; the gather of the transformer's output is the same tensor on
every process, so its backward keeps the process's own block of the gradient (the loss is computed
whole on every process, once per group)."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist


@attrs.define(eq=False)
class Ulysses:
    """This process's context-parallel group: ``size`` processes, this one ``rank`` in it; the
    token blocks of the current forward (set when the transformer splits its input)."""

    group: Any
    size: int
    rank: int
    #: tokens each process holds, by kind ("image", "text"), of the forward under way
    blocks: dict[str, list[int]] = attrs.field(factory=dict)

    def split(self, x: torch.Tensor, kind: str, dim: int = 1) -> torch.Tensor:
        """This process's block of ``x``'s tokens (along ``dim``); remembers every process's block size."""
        sizes = [len(part) for part in torch.arange(x.shape[dim]).tensor_split(self.size)]
        self.blocks[kind] = sizes
        start = sum(sizes[: self.rank])
        return x.narrow(dim, start, sizes[self.rank])

    def sizes(self, *kinds: str) -> list[int]:
        """Every process's token count of a sequence made of its blocks of ``kinds`` (concatenated)."""
        return [sum(self.blocks[kind][r] for kind in kinds) for r in range(self.size)]

    def to_heads(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """(B, my tokens, H, D) -> (B, all tokens, H / size, D): the whole sequence, my heads."""
        return _Exchange.apply(x, self, sizes, True)

    def to_tokens(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """(B, all tokens, H / size, D) -> (B, my tokens, H, D): the inverse of :meth:`to_heads`."""
        return _Exchange.apply(x, self, sizes, False)

    def gather(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """(B, my tokens, ...) -> (B, all tokens, ...), the same on every process of the group."""
        return _Gather.apply(x, self, self.blocks[kind])


def _exchange(x: torch.Tensor, ulysses: Ulysses, send: list[int], receive: list[int]) -> torch.Tensor:
    """All-to-all of ``x``'s rows: ``send[j]`` consecutive rows go to process j, ``receive[i]``
    arrive from process i (in process order)."""
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=ulysses.group
    )
    return out


def tokens_to_heads(x: torch.Tensor, ulysses: Ulysses, sizes: list[int]) -> torch.Tensor:
    batch, mine, heads, dim = x.shape
    u = ulysses.size
    # rows grouped by the process that takes them: head block j of my tokens goes to process j
    send = x.reshape(batch, mine, u, heads // u, dim).permute(2, 1, 0, 3, 4).reshape(u * mine, batch, heads // u, dim)
    got = _exchange(send, ulysses, [mine] * u, sizes)  # every process's tokens, in sequence order
    return got.permute(1, 0, 2, 3)


def heads_to_tokens(x: torch.Tensor, ulysses: Ulysses, sizes: list[int]) -> torch.Tensor:
    batch, _, part, dim = x.shape
    u, mine = ulysses.size, sizes[ulysses.rank]
    got = _exchange(x.permute(1, 0, 2, 3), ulysses, sizes, [mine] * u)  # from process i: head block i
    return got.reshape(u, mine, batch, part, dim).permute(2, 1, 0, 3, 4).reshape(batch, mine, u * part, dim)


class _Exchange(torch.autograd.Function):
    """:func:`tokens_to_heads` (``to_heads``) or :func:`heads_to_tokens`; its backward is the other."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ulysses: Ulysses, sizes: list[int], to_heads: bool) -> torch.Tensor:
        ctx.ulysses, ctx.sizes, ctx.to_heads = ulysses, sizes, to_heads
        return (tokens_to_heads if to_heads else heads_to_tokens)(x, ulysses, sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return (heads_to_tokens if ctx.to_heads else tokens_to_heads)(grad, ctx.ulysses, ctx.sizes), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ulysses: Ulysses, sizes: list[int]) -> torch.Tensor:
        ctx.start, ctx.mine = sum(sizes[: ulysses.rank]), sizes[ulysses.rank]
        longest = max(sizes)
        padded = torch.nn.functional.pad(x, (0,) * (2 * (x.dim() - 2)) + (0, longest - x.shape[1]))
        parts = [torch.empty_like(padded) for _ in range(ulysses.size)]
        dist.all_gather(parts, padded.contiguous(), group=ulysses.group)
        return torch.cat([part[:, :n] for part, n in zip(parts, sizes, strict=True)], dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # every process computed the same loss from the same gathered output: its own block of the
        # gradient is its share, and the group's gradients add up to the one-process gradient
        return grad.narrow(1, ctx.start, ctx.mine).contiguous(), None, None


def new_groups(size: int) -> Ulysses:
    """Groups of ``size`` consecutive processes (every process creates every group, as
    ``torch.distributed.new_group`` requires); this process's one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = Ulysses(group=group, size=size, rank=rank - first)
    assert mine is not None
    return mine
