"""Batch-first operations on conditioning, which may be a tensor or a nested dict/tuple/list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v) for v in tree)
    return tree  # non-tensor leaves (None, strings, numbers) are shared, not batched


def repeat_interleave(tree: Any, repeats: int) -> Any:
    """[a, b] -> [a, a, ..., b, b, ...]: each row ``repeats`` times (a group per prompt)."""
    return tree_map(lambda t: t.repeat_interleave(repeats, dim=0), tree)


def index(tree: Any, idx: torch.Tensor | slice | list[int]) -> Any:
    return tree_map(lambda t: t[idx], tree)


def cat(trees: list[Any]) -> Any:
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(trees, dim=0)
    if isinstance(first, dict):
        return {k: cat([t[k] for t in trees]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(cat(list(parts)) for parts in zip(*trees, strict=True))
    return first


def to(tree: Any, device: torch.device | str) -> Any:
    return tree_map(lambda t: t.to(device), tree)
