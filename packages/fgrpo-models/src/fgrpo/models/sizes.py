"""What a backbone declares about its real sizes (on its policy class, read by ``tools/memory.py``,
``tools/gpu/bench_real_size.py`` and ``tools/reference_parity_sizes.py``): the token geometry of a
sample (:class:`Geometry`) and, per published checkpoint, its sizes and its transformer's published
``config.json`` structure (:class:`Published`). A new backbone declares both beside its code; no
tool keeps a table of backbones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs


@attrs.frozen
class Geometry:
    """How a sample becomes tokens: a token covers ``spatial`` x ``spatial`` pixels (VAE x patch),
    ``temporal`` frames (video; None for images); the text adds ``extra_text_tokens`` to the
    prompt's; a token carries ``values_per_token`` latent values (channels x patch area)."""

    spatial: int = 16
    temporal: int | None = None
    extra_text_tokens: int = 0
    values_per_token: int = 64


@attrs.frozen
class Published:
    """A published checkpoint: parameters of its transformer (each expert of a mixture), text
    encoders and VAE, the transformer's hidden size and block count (approximate, for when its
    configs are not at hand), its own geometry where it differs from the backbone's, and the
    transformer's ``config.json`` as published (structure only; ``source`` says where from)."""

    transformer: float
    text: float
    vae: float
    hidden: int
    layers: int
    experts: int = 1
    geometry: Geometry | None = None
    config: Mapping[str, Any] | None = None
    source: str = ""


def guidance_forwards(scale: Any) -> int:
    """Forwards per sample of true classifier-free guidance at ``scale`` (two above 1)."""
    return 2 if scale is not None and float(scale) > 1.0 else 1
