"""Where each network of a diffusers backbone goes when it loads: the load plan.

:func:`plan` says, for each pipeline component (``transformer``, ``vae``, ``text_encoder``...),
whether it lives on the accelerator or on the host, in which weights dtype, and whether the
launch builds it as shards. It is pure (no file read, no device touched): ``fgrpo memory``
reads it to estimate memory per process, and :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy`
follows it when it loads, moving each module once, straight from the loader to its final device
and dtype. So a text encoder kept on the CPU (``text_encoder_device: cpu``) never passes through
the GPU, and the VAE and text encoders are cast on the host before they move.

``sharded`` components (the networks an FSDP2 or DeepSpeed ZeRO-3 launch splits, with LoRA or
fully fine-tuned: the transformer, Wan 2.2's two experts) are never
whole in one process: they are built from their config without weights, and each process reads
only its shard of the safetensors files (:mod:`fgrpo.models.sharded_load`). Other launch kinds
load them whole (docs/backbones.md, "Load plan").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from fgrpo.models import _diffusers as dx

#: the roles of :class:`Placement`
ACCELERATOR = "accelerator"
HOST = "host"


@attrs.frozen
class Placement:
    """One pipeline component at load time."""

    #: the pipeline's attribute (``transformer``, ``transformer_2``, ``vae``, ``text_encoder``...)
    name: str
    #: ``"accelerator"`` (the policy's ``device``) or ``"host"`` (the CPU)
    role: str
    #: its weights dtype once placed (modules diffusers keeps in float32 keep them)
    dtype: torch.dtype
    #: built without weights and filled shard by shard after the launch shards it
    sharded: bool


def _role(device: Any) -> str:
    """'cpu' -> host; 'auto', 'cuda', 'cuda:N', 'mps' (or a torch.device of them) -> accelerator.
    'auto' counts as the accelerator: the plan is what a machine with one does."""
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return HOST if kind == "cpu" else ACCELERATOR


def plan(
    policy_class: Any,
    keys: Mapping[str, Any],
    shards: bool = False,
    components: Sequence[str] | None = None,
) -> list[Placement]:
    """The load plan of a diffusers backbone (``policy_class``: a
    :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` subclass) with the recipe's model
    ``keys`` (``dtype``, ``vae_dtype``, ``text_encoder_dtype``, ``device``,
    ``text_encoder_device``, ``lora``, the backbone's own). ``shards``: the launch loads the
    network it shards shard by shard: the ``loads_shards`` of its class in
    :mod:`fgrpo.core.launch` (FSDP2: ``launch_class("FSDP").loads_shards``; a run's own:
    :func:`fgrpo.core.launch.loads_shards`; ZeRO-3 too), with LoRA or fully fine-tuned; data
    parallel and DeepSpeed ZeRO-2 load whole.
    ``components``: the pipeline's network attributes when known (a built policy passes its
    own); by default the backbone's ``planned_components(keys)``.

    Order: the sharded components first, then the accelerator's, then the host's: the order in
    which the policy places them. Components other than the transformers, VAE and text encoders
    (an image encoder a pipeline carries) go to the accelerator in ``dtype``, as the pipeline
    would move them."""
    dtype = dx.parse_dtype(keys.get("dtype") or "float32")
    vae_dtype = dx.parse_dtype(keys["vae_dtype"]) if keys.get("vae_dtype") else dtype
    text_dtype = dx.parse_dtype(keys["text_encoder_dtype"]) if keys.get("text_encoder_dtype") else dtype
    device = keys.get("device") or "auto"
    text_device = keys.get("text_encoder_device") or device
    names = list(components) if components is not None else list(policy_class.planned_components(keys))
    sharded = set(policy_class.sharded_components(keys, names)) if shards else set()
    text = set(policy_class.text_encoder_names)
    placements = []
    for name in names:
        if name in text:
            placements.append(Placement(name, _role(text_device), text_dtype, False))
        elif name == "vae":
            placements.append(Placement(name, _role(device), vae_dtype, False))
        else:
            placements.append(Placement(name, _role(device), dtype, name in sharded))
    return sorted(placements, key=lambda p: (not p.sharded, p.role != ACCELERATOR))
