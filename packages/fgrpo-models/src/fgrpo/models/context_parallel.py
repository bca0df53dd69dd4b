"""Context (sequence) parallelism of a diffusers transformer: the recipe key and its checks.

diffusers 0.42.1 splits a transformer's token sequence over processes through
``ModelMixin.enable_parallelism(config=ContextParallelConfig(ulysses_degree=U, ring_degree=R))``:
the ``U x R`` processes of one context-parallel group each attend over their share of every
sample's tokens (Ulysses: an all-to-all over heads; ring: key/value blocks passed round), so the
group must feed the transformer the same samples. For fgrpo that means: the processes of a group
share prompt groups, noise and rewards, the rollout and the update run under the same mesh, and
gradients are summed within a group and averaged over groups. That mapping is not built yet, so
``model.context_parallel`` validates its form at ``fgrpo validate`` and is refused, with its
reason, when the run is built:

- on a machine without GPUs diffusers cannot set it up: ``_resolve_parallel_config`` computes
  ``rank % torch.accelerator.device_count()`` (ZeroDivisionError with 0 devices,
  modeling_utils.py:1719 of diffusers 0.42.1) before it uses any mesh it is given;
- on GPUs the group-to-process mapping above is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: the keys of ``model.context_parallel`` (diffusers' ContextParallelConfig's degrees)
KEYS = ("ulysses_degree", "ring_degree")

HELP = (
    "split each sample's tokens over processes with diffusers' ContextParallelConfig: a mapping of ulysses_degree "
    "and ring_degree (positive integers, product > 1); null: off. Refused when the run is built (on CPUs diffusers "
    "cannot set it up; on GPUs fgrpo does not yet map a context-parallel group's processes to the same samples)"
)


def convert(value: Any) -> dict[str, int] | None:
    """``model.context_parallel`` normalised: None, or both degrees as integers. Raises
    ``ValueError("got ...; allowed ...")`` for bad values (reported under the key by validate)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"got {value!r}; allowed: null (off) or a mapping with keys {', '.join(KEYS)}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise ValueError(f"got unknown key(s) {', '.join(map(repr, unknown))}; allowed keys: {', '.join(KEYS)}")
    spec = {key: value.get(key, 1) for key in KEYS}
    for key, degree in spec.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"got {key} {degree!r}; allowed: a positive integer")
    if spec["ulysses_degree"] * spec["ring_degree"] < 2:
        raise ValueError(
            f"got {dict(spec)}: one process per sample is no context parallelism; allowed: degrees whose product is > "
            f"1, or null"
        )
    return spec


def refusal(spec: Mapping[str, int], accelerators: int) -> str:
    """Why a run with ``model.context_parallel: spec`` cannot be built on a machine with
    ``accelerators`` devices (``torch.accelerator.device_count()``)."""
    size = spec["ulysses_degree"] * spec["ring_degree"]
    if accelerators == 0:
        return (
            f"model.context_parallel ({size} processes per sample) needs GPUs: diffusers' enable_parallelism maps "
            f"each "
            "process to an accelerator device (rank % torch.accelerator.device_count(), which is 0 here: "
            "ZeroDivisionError in diffusers 0.42.1 modeling_utils.py:1719); set model.context_parallel: null on a CPU"
        )
    return (
        f"model.context_parallel ({size} processes per sample) is not supported yet: fgrpo does not give the "
        f"processes "
        "of a context-parallel group the same prompts, noise and rewards, nor sum their gradients within the group; "
        "set model.context_parallel: null (for memory: a sharded launch and gradient checkpointing, "
        "recipes/accelerate/README.md)"
    )


def check(spec: Mapping[str, int] | None) -> None:
    """Refuse ``spec`` (not None) with :func:`refusal`'s reason for this machine."""
    if spec is None:
        return
    import torch

    accelerators = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    raise ValueError(refusal(spec, accelerators))
