"""The prompt -> vector convention shared by the ``vector`` policy and the ``target-distance`` reward.

A vector prompt names the point its sample should land on:

- ``"target 0.5 -1.0"`` (also ``"go to target: (0.5, -1)"``, ``"TARGET=[0.5,-1]"``): the numbers
  that follow the word ``target`` are the target; there must be exactly ``dim`` of them.
- a prompt without the word ``target`` (``"a cat"``) gets a pseudo-random target, a pure function
  of its text: each coordinate uniform in [-1, 1] (SHAKE-256 of the UTF-8 text, so it is the same
  on every machine, process and Python version).
- a reward may also read ``metadata["target"]`` (a list of ``dim`` numbers), which takes
  precedence over the prompt; the policy never sees metadata, so such a target is only learnable
  when it is a function of the prompt text.

The policy's conditioning vector (:func:`condition_vector`) starts with that same target and is
filled up to ``cond_dim`` with a hashed code of the text, so whatever the reward checks, the
policy can read.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_TARGET = re.compile(rf"\btarget\b\s*[:=]?\s*[\(\[]?\s*((?:{_NUMBER})(?:\s*,?\s*{_NUMBER})*)", re.IGNORECASE)
_NUMBERS = re.compile(_NUMBER)


def target_numbers(prompt: str) -> list[float] | None:
    """The numbers after the word ``target`` in ``prompt``; None when it names no target."""
    match = _TARGET.search(prompt)
    if match is None:
        return None
    return [float(v) for v in _NUMBERS.findall(match.group(1))]


def hashed_vector(text: str, n: int, *, salt: str = "") -> torch.Tensor:
    """``n`` float32 values uniform in [-1, 1], a deterministic function of ``text`` (and ``salt``)."""
    if n <= 0:
        return torch.zeros(0)
    raw = hashlib.shake_256((salt + text).encode("utf-8")).digest(2 * n)
    ints = torch.tensor([int.from_bytes(raw[2 * i : 2 * i + 2], "little") for i in range(n)])
    return (ints.to(torch.float32) / 65535.0) * 2.0 - 1.0


def target_vector(prompt: str, dim: int, metadata: Mapping[str, Any] | None = None) -> torch.Tensor:
    """The (dim,) float32 target of a prompt; raises ``ValueError`` on a malformed one."""
    if metadata is not None and metadata.get("target") is not None:
        value = torch.as_tensor(metadata["target"], dtype=torch.float32).flatten()
        if value.numel() != dim:
            raise ValueError(
                f"metadata target {list(map(float, value))} of prompt {prompt!r} has "
                f"{value.numel()} numbers; the outputs have {dim} dimensions"
            )
        return value
    numbers = target_numbers(prompt)
    if numbers is None:
        return hashed_vector(prompt, dim, salt="target:")
    if len(numbers) != dim:
        raise ValueError(
            f"prompt {prompt!r} names a target of {len(numbers)} numbers; the outputs have "
            f"{dim} dimensions (write e.g. 'target {' '.join(['0.5'] * dim)}')"
        )
    return torch.tensor(numbers, dtype=torch.float32)


def target_vectors(
    prompts: Sequence[str], dim: int, metadata: Sequence[Mapping[str, Any]] | None = None
) -> torch.Tensor:
    """(B, dim) targets of a batch of prompts (``metadata`` aligned with ``prompts`` if given)."""
    metas: Sequence[Mapping[str, Any] | None] = metadata if metadata else [None] * len(prompts)
    if len(metas) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(metas)} metadata entries")
    if not prompts:
        return torch.zeros(0, dim)
    return torch.stack([target_vector(p, dim, m) for p, m in zip(prompts, metas, strict=True)])


def condition_vector(prompt: str, dim: int, cond_dim: int) -> torch.Tensor:
    """The (cond_dim,) conditioning of a prompt: its target, then a hashed code of its text.

    Cut to ``cond_dim`` when ``cond_dim < dim``; ``cond_dim == 0`` is an unconditional policy.
    """
    target = target_vector(prompt, dim)
    extra = hashed_vector(prompt, max(cond_dim - dim, 0), salt="code:")
    return torch.cat([target, extra])[:cond_dim]
