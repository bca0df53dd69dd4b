"""The passes of a sharded run in lockstep: every process makes the same forwards in the same order.

Where every forward or backward involves every process (FSDP's all-gathers and reduce-scatters,
DeepSpeed's partitions), each process must call the same network at the same point: a process
with fewer passes pads them (``launch.missing_forwards`` / ``missing_backwards``). A policy whose
rows run through one of several networks by noise level (``Policy.forward_groups``: Wan 2.2's
experts) needs more: the k-th pass of every process must run the same networks. So each pass is
split by group, the group's parts are made together (group 0 first), and every process pads each
group to the busiest process's count with zero-weighted passes of that group (at its level).

A split pass weighs what its pairs weigh in the whole (the update weights a pass by its share of
the step's pairs), so the gradient is the same sum, only added in another order. A data-parallel
run keeps its passes as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fgrpo.core.protocols import ForwardGroups

Pass = tuple[torch.Tensor, torch.Tensor]  # (item, unit) pairs evaluated in one forward
#: a pass to make, or None: a zero-weighted padding pass at the level given (None: any pair's)
Planned = tuple[Pass | None, float | None]


def forward_groups(policy: Any) -> ForwardGroups | None:
    """The policy's groups of forwards, None for one network (or one group)."""
    groups = getattr(policy, "forward_groups", None)
    return groups if groups is not None and len(groups.levels) > 1 else None


def split(groups: ForwardGroups, passes: Sequence[Pass], levels: Callable[[Pass], torch.Tensor]) -> list[list[Pass]]:
    """Per group, the parts of ``passes`` whose pairs its forward runs, in the passes' order
    (``levels(pass)``: each pair's noise level)."""
    parts: list[list[Pass]] = [[] for _ in groups.levels]
    for rows, cols in passes:
        group = groups.of(levels((rows, cols))).cpu()
        for g, own in enumerate(parts):
            where = (group == g).nonzero().squeeze(1)
            if len(where):
                own.append((rows[where.to(rows.device)], cols[where.to(cols.device)]))
    return parts


def plan(
    policy: Any,
    passes: Sequence[Pass],
    levels: Callable[[Pass], torch.Tensor],
    missing: Callable[[int], int],
    collective: bool,
) -> list[Planned]:
    """The passes this process makes, with its padding: ``passes`` then ``missing(len(passes))``
    padding passes; where ``collective`` (every process takes part in each pass) and the policy has
    forward groups, per group its parts then its own padding, so that every process runs the same
    group at the same point. ``missing`` is a collective: every process calls it as often."""
    groups = forward_groups(policy) if collective else None
    if groups is None:
        return [(p, None) for p in passes] + [(None, None)] * missing(len(passes))
    planned: list[Planned] = []
    for level, own in zip(groups.levels, split(groups, passes, levels), strict=True):
        planned += [(p, None) for p in own] + [(None, level)] * missing(len(own))
    return planned


__all__ = ["Pass", "Planned", "forward_groups", "plan", "split"]
