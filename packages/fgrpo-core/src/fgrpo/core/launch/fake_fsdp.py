"""The FSDP2 launch on fake tensors, for ``fgrpo memory --launch fsdp``: the launch's own sharding
(:func:`fgrpo.core.launch.fsdp.shard_policy`, accelerate's ``fsdp2_prepare_model`` with the plugin
of ``recipes/accelerate/fsdp-lora.yaml`` / ``fsdp-full.yaml``: one ``fully_shard`` unit per block of
the transformer's ``_no_split_modules``, then the whole module) run on a fake process group of N
ranks (``FakeStore``: every collective returns at once, nothing is communicated); this process is
rank 0, whose shards are each parameter's first ``ceil(dim0 / N)`` rows (FSDP2 pads dim 0 to a
multiple of N).

The peaks are measured with torch's ``FSDPMemTracker`` (:func:`tracker_class`): sharded weights, the
blocks' all-gathered weights during forward and backward, reduce-scattered gradients and the
optimizer state of the shards are what it sees. The backbones' harness (``fgrpo.models.fake_size``)
loads the network as the launch loads it, shard by shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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
        # the launch broadcasts process 0's initial weights: over the fake group, a collective that moves nothing
        num_processes=mesh.size(),
    )
    acc.prepare = lambda module, optimizer: _prepare(acc, module, optimizer)
    return acc


def shard(mesh: Any, policy: Any, optimizer: torch.optim.Optimizer, precision: str) -> list[torch.nn.Parameter]:
    """The launch's sharding of ``policy`` (:func:`fgrpo.core.launch.fsdp.shard_policy`) on the fake
    group's ``mesh``."""
    from fgrpo.core.launch.fsdp import shard_policy

    return shard_policy(accelerator(mesh, precision), policy, optimizer)


def _prepare(acc: Any, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """accelerate's FSDP2 ``prepare`` of one module and its optimizer: ``fsdp2_prepare_model``, then the
    optimizer's parameters switched to the sharded ones of the same name."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:  # full fine-tuning: the optimizer holds the stand-ins replaced on meta
        group["params"] = [_REPLACED.get(id(p), p) for p in group["params"]]
    prepared = fsdp2_prepare_model(acc, module)
    sharded = dict(prepared.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]
    return prepared, optimizer


#: while the launch shards on meta (``sharded_load.to_meta`` up to the shards' fill): the meta
#: tensors it makes, which the harness's host stand-in (meta) would otherwise count
_ON_META = [False]
#: id of a parameter the harness replaced by a meta one -> the replacement, while sharding
_REPLACED: dict[int, torch.nn.Parameter] = {}


@contextlib.contextmanager
def sharding_on_meta(replaced: dict[int, torch.nn.Parameter]) -> Iterator[None]:
    _ON_META[0] = True
    _REPLACED.update(replaced)
    try:
        yield
    finally:
        _ON_META[0] = False
        _REPLACED.clear()


def untracked(t: torch.Tensor) -> bool:
    """A tensor the memory trackers leave out: one of the launch's meta tensors (see :data:`_ON_META`)."""
    return _ON_META[0] and t.device.type == "meta"


#: FSDPMemTracker's kinds as ``fgrpo memory`` names them: a process's shards are its parameters,
#: gradients and optimizer state; what a block gathers for its forward and backward is apart
KINDS = {
    "Sharded Param": "Parameter",
    "Unsharded Param": "Parameter (gathered)",
    "Sharded Grad": "Gradient",
    "Unsharded Grad": "Gradient (unsharded)",
    "OptState": "Optstate",
    "All Gather": "All-gather buffer",
    "Reduce Scatter": "Reduce-scatter buffer",
    "Inputs": "Activation",
}


def tracker_class(restart: type) -> type:
    """``FSDPMemTracker`` with ``restart`` (``fgrpo memory``'s hooks that let a root module be called
    again) also where FSDP's own hooks run first, and with MemTracker's ``track_external``."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPModMemStats
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(restart, FSDPMemTracker):
        def _fsdp_state_pre_forward(self, module: Any, original: Any) -> Any:
            hook = super()._fsdp_state_pre_forward(module, original)  # runs before _pre_fw_hook

            def again(*args: Any, **kwargs: Any) -> Any:
                self._again(module)
                return hook(*args, **kwargs)

            return again

        def _known(self, module: Any) -> None:
            # a block that ran before the last restart only (Wan 2.2's other expert in the rollout):
            # FSDP finalises it after the backward, which FSDPMemTracker's hooks take for a block of this pass
            if module not in self.memory_tracking:
                self.memory_tracking[module] = _FSDPModMemStats(self._mod_tracker.get_known_fqn(module) or "")

        def _fsdp_param_group_pre_backward(self, module: Any, original: Any) -> Any:
            return self._after_known(module, super()._fsdp_param_group_pre_backward(module, original))

        def _fsdp_param_group_post_backward(self, module: Any, original: Any) -> Any:
            return self._after_known(module, super()._fsdp_param_group_post_backward(module, original))

        def _after_known(self, module: Any, hook: Any) -> Any:
            def known(*args: Any, **kwargs: Any) -> Any:
                self._known(module)
                return hook(*args, **kwargs)

            return known

        def track_external(self, *external: Any) -> None:
            MemTracker.track_external(self, *external)  # FSDPMemTracker's is a no-op

        def _update_snap(
            self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None, old_reftype: Any = None
        ) -> None:
            # MemTracker's kinds (what track_external files) beside FSDPMemTracker's
            snap = self._curr_mem_snap.setdefault(winfo.device, dict.fromkeys(self._ref_class, 0))
            snap.setdefault(winfo.reftype, 0)
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    return Tracker
