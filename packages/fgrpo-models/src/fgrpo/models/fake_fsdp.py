"""The FSDP2 launch on fake tensors, for ``fgrpo memory --launch fsdp``: the launch's own sharding
(:func:`fgrpo.core.launch.fsdp.shard_policy`, accelerate's ``fsdp2_prepare_model`` with the plugin
of ``recipes/accelerate/fsdp-lora.yaml`` / ``fsdp-full.yaml``: one ``fully_shard`` unit per block of
the transformer's ``_no_split_modules``, then the whole module) run on a fake process group of N
ranks (``FakeStore``: every collective returns at once, nothing is communicated); this process is
rank 0, whose shards are each parameter's first ``ceil(dim0 / N)`` rows (FSDP2 pads dim 0 to a
multiple of N).

The trained transformer loads as the launch loads it (:mod:`fgrpo.models.sharded_load`): zero-stride
stand-ins, the recipe's LoRA on them, meta tensors just before ``fully_shard``, then this process's
shard of each weight allocated (a fake tensor: nothing is read). The peaks are measured with torch's
``FSDPMemTracker``: sharded weights, the blocks' all-gathered weights during forward and backward,
reduce-scattered gradients and the optimizer state of the shards are what it sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

#: the mesh dimension the fake launch shards over (accelerate's name for FSDP's data-parallel shard)
SHARD_DIM = "dp_shard"


@contextlib.contextmanager
def fake_group(ranks: int) -> Iterator[Any]:
    """Outside fake mode: a fake process group of ``ranks`` ranks, this process rank 0, and its 1-D
    device mesh (a mesh made under ``FakeTensorMode`` would hold a fake rank tensor); torn down after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fgrpo memory --launch fsdp: a process group is already initialised in this process")
    dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (ranks,), mesh_dim_names=(SHARD_DIM,))
    finally:
        dist.destroy_process_group()


def stand_ins(module: torch.nn.Module, device: torch.device) -> list[Any]:
    """Inside fake mode: ``module``'s (on meta) weights as the launch's zero-stride stand-ins on
    ``device`` and its buffers allocated there; returns them as :class:`sharded_load.StandIn`."""
    from fgrpo.models import fake_size, sharded_load

    pending = []
    with fake_size.placing():
        for key, param in list(module.named_parameters()):
            owner, attr = sharded_load._owner(module, key)
            blank = torch.zeros((), dtype=param.dtype, device=device).expand(param.shape)
            owner._parameters[attr] = torch.nn.Parameter(blank, requires_grad=False)
            pending.append(sharded_load.StandIn(owner, attr, key, Path("(fake)")))
        for owner in module.modules():
            for attr, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[attr] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return pending


def fill(pending: list[Any], device: torch.device) -> None:
    """Inside fake mode, once sharded: this process's shard of each stand-in, allocated on ``device``
    (what :func:`sharded_load.fill` reads from the files)."""
    from fgrpo.models import fake_size, sharded_load

    for item in pending:
        param = getattr(item.owner, item.attr)
        local, _ = sharded_load._local_rows(param)
        with fake_size.placing():
            shard = torch.empty(local.shape, dtype=local.dtype, device=device)
        sharded_load._swap_local(param, shard)


def accelerator(mesh: Any, mixed_precision: str = "bf16") -> Any:
    """What ``shard_policy`` needs of an Accelerator launched with ``fsdp-lora.yaml`` /
    ``fsdp-full.yaml``: their FSDP2 plugin (transformer-based wrap, reshard after forward, no
    offload, the run's mixed precision) and ``prepare``, which shards as accelerate's does."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        reshard_after_forward=True,
        cpu_offload=False,
        cpu_ram_efficient_loading=False,
        activation_checkpointing=False,
        state_dict_type="FULL_STATE_DICT",
    )
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    acc = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=mesh,
        parallelism_config=SimpleNamespace(fsdp_dim_names=(SHARD_DIM,)),
        mixed_precision=mixed_precision,
        # fsdp2_prepare_model reads it only to log (accelerate's logger wants a PartialState, which
        # this fake launch does not make) and for cpu_ram_efficient_loading, which the configs leave off
        is_main_process=False,
        device=torch.device("cpu"),
    )
    acc.prepare = lambda module, optimizer: _prepare(acc, module, optimizer)
    return acc


def _prepare(acc: Any, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """accelerate's FSDP2 ``prepare`` of one module and its optimizer: ``fsdp2_prepare_model``, then the
    optimizer's parameters switched to the sharded ones of the same name."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    names = {id(p): n for n, p in module.named_parameters()}
    prepared = fsdp2_prepare_model(acc, module)
    sharded = dict(prepared.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return prepared, optimizer


#: while the launch shards on meta (``sharded_load.to_meta`` up to the shards' fill): the meta
#: tensors it makes, which the harness's host stand-in (meta) would otherwise count
_ON_META = [False]


@contextlib.contextmanager
def sharding_on_meta() -> Iterator[None]:
    _ON_META[0] = True
    try:
        yield
    finally:
        _ON_META[0] = False


def untracked(t: torch.Tensor) -> bool:
    """A tensor the memory trackers leave out: one of the launch's meta tensors (see :data:`_ON_META`)."""
    return _ON_META[0] and t.device.type == "meta"
