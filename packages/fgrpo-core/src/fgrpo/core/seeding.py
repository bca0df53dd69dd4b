"""Every random draw of a run comes from a generator derived from (seed, purpose, counters).

Nothing depends on a global RNG's history, so an iteration is reproducible from its number alone:
resume is exact, and a rollout chunk draws the same noise whichever process runs it.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, *parts: object) -> int:
    text = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def randn(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor:
    """Standard normal float32 noise on ``device``, drawn on the generator's device (so a seed gives
    the same numbers wherever the result goes)."""
    where = generator.device if generator is not None else torch.device(device)
    return torch.randn(tuple(shape), generator=generator, device=where, dtype=torch.float32).to(device)


def generator(seed: int, *parts: object, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, *parts))
    return g
