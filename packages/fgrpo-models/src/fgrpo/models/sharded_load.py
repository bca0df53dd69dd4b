"""Loading the networks an FSDP2 or DeepSpeed ZeRO-3 launch shards without ever holding them whole.

A sharded component of the load plan (:mod:`fgrpo.models.load_plan`) is built from its config
without weights (accelerate's ``init_empty_weights``); each weight then becomes a *stand-in*: a
tensor of the right shape, dtype and device whose one element is broadcast over the shape (zero
strides), so it takes no memory. A stand-in, not a meta tensor, while the policy is built: peft puts a
LoRA adapter on the device of the layer it wraps, and a meta base layer would leave the adapter
on meta, its initial weights (drawn from the run's seed) lost. The persistent buffers (small) are
read whole.

Just before ``accelerator.prepare`` the stand-ins become meta tensors (:func:`to_meta`:
``fully_shard`` refuses tensors with zero strides, and shards meta ones on meta); once sharded,
:func:`fill` allocates this process's shard of each and reads its rows from the safetensors files
(``safe_open(...).get_slice(name)[start:stop]``): in no process are the transformer's weights
ever whole, neither in host nor in accelerator memory. The values are the whole load's: the
file's tensor cast to the dtype ``from_pretrained`` gives it (float32 for the modules the
model class keeps in float32, else the load dtype).

Under DeepSpeed ZeRO-3 the stand-ins stay until ``prepare`` (the frozen ones of LoRA, or every
weight under full fine-tuning), which first makes each a partitioned parameter holding only this
process's flat partition (:func:`partition`, with the launch's ``place``:
:mod:`fgrpo.core.launch.zero3_load`), read from the rows of the file that hold it.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch

log = logging.getLogger(__name__)


@attrs.frozen
class StandIn:
    """A weight still to read: ``getattr(owner, attr)`` is its stand-in, later its shard."""

    owner: torch.nn.Module
    attr: str
    key: str  # its name in the safetensors files
    file: Path
    #: the dtype ``from_pretrained`` gives it: the file's values pass through it, as in a whole load,
    #: also when the launch upcasts the (trained) parameter before reading (FSDP2 under mixed precision)
    dtype: torch.dtype


def weight_files(folder: Path) -> dict[str, Path] | None:
    """Tensor name -> safetensors file of one component's folder (an index's weight map, or its one
    file); None without safetensors weights (a .bin checkpoint: loaded whole)."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        return None
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt") as f:
        return dict.fromkeys(f.keys(), files[0])


def _load_dtype(cls: Any, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``from_pretrained(torch_dtype=dtype)`` gives the floating tensor ``name``."""
    keep = cls._keep_in_fp32_modules or []
    return torch.float32 if any(m in name.split(".") for m in keep) else dtype


def stand_in_model(
    folder: Path, name: str, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, list[StandIn]] | None:
    """The pipeline component ``name`` of the pipeline folder ``folder`` as stand-ins (with its
    persistent buffers read), and the weights still to read; None when it cannot be (no
    safetensors files, a weight the files lack): it is then loaded whole."""
    import diffusers
    from accelerate import init_empty_weights

    library, class_name = json.loads((folder / "model_index.json").read_text()).get(name, [None, None])
    files = weight_files(folder / name) if library == "diffusers" and class_name else None
    if files is None:
        return None
    cls = getattr(diffusers, class_name)
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(cls.load_config(str(folder), subfolder=name))
    params = dict(model.named_parameters())
    persistent = [n for n in model.state_dict() if n not in params]
    missing = [n for n in [*params, *persistent] if n not in files]
    if missing:
        log.info("%s: %s is not in its safetensors files; it loads whole", name, missing[0])
        return None
    pending = []
    for key, param in params.items():
        owner, attr = _owner(model, key)
        blank = torch.zeros((), dtype=_load_dtype(cls, key, dtype) if param.is_floating_point() else param.dtype)
        owner._parameters[attr] = torch.nn.Parameter(blank.to(device).expand(param.shape), requires_grad=False)
        pending.append(StandIn(owner, attr, key, files[key], blank.dtype))
    _read_buffers(model, cls, persistent, files, dtype)
    for buffer_owner in model.modules():  # non-persistent buffers, as built: on the device, as the pipeline moves them
        for attr, buffer in buffer_owner._buffers.items():
            if buffer is not None:
                buffer_owner._buffers[attr] = buffer.to(device)
    model.register_to_config(_name_or_path=str(folder / name))
    model.eval()
    return model, pending


def _owner(model: torch.nn.Module, key: str) -> tuple[torch.nn.Module, str]:
    prefix, _, attr = key.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), attr


def _read_buffers(model: torch.nn.Module, cls: Any, names: Sequence[str], files: dict[str, Path], dtype: Any) -> None:
    from safetensors import safe_open

    for key in names:
        with safe_open(str(files[key]), framework="pt") as f:
            value = f.get_tensor(key)
        owner, attr = _owner(model, key)
        owner._buffers[attr] = value.to(_load_dtype(cls, key, dtype)) if value.is_floating_point() else value


def to_meta(pending: Sequence[StandIn]) -> None:
    """The stand-ins as meta tensors, just before the launch shards the module: ``fully_shard``
    takes no zero-stride tensor, and keeps a meta one on meta, sharded, for :func:`fill`. In place
    (the same parameter objects): under full fine-tuning the optimizer holds them, and accelerate
    matches its parameters to the sharded ones by the identity of meta parameters."""
    for item in pending:
        param = getattr(item.owner, item.attr)
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        torch.utils.swap_tensors(param, torch.nn.Parameter(meta, requires_grad=param.requires_grad))


def fill(pending: Sequence[StandIn], device: torch.device | str) -> None:
    """Read each weight's values onto ``device``: this process's rows of an FSDP2 shard (a DTensor
    sharded on dim 0 in ``torch.chunk`` pieces; FSDP re-pads it at its first forward, as after
    ``to_empty``), or the whole tensor when nothing sharded it."""
    from fgrpo.core.launch.shards import is_sharded_tensor

    with torch.no_grad():
        for f, item in _opened(pending):
            param = getattr(item.owner, item.attr)
            if not is_sharded_tensor(param):
                whole = f.get_tensor(item.key).to(item.dtype).to(device, param.dtype)
                item.owner._parameters[item.attr] = torch.nn.Parameter(whole, requires_grad=param.requires_grad)
                continue
            meta, start = _local_rows(param)
            local = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            if local.numel():
                local.copy_(f.get_slice(item.key)[start : start + local.shape[0]].to(item.dtype))
            _swap_local(param, local)


def _opened(pending: Sequence[StandIn]) -> Iterator[tuple[Any, StandIn]]:
    """(the open safetensors file, the stand-in) for every stand-in, each file opened once."""
    from safetensors import safe_open

    by_file: dict[Path, list[StandIn]] = {}
    for item in pending:
        by_file.setdefault(item.file, []).append(item)
    for file, items in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for item in items:
                yield f, item


@contextmanager
def sharding(
    pending: Sequence[StandIn], module: torch.nn.Module, device: torch.device | str, place: Any = None
) -> Iterator[None]:
    """Around the launch's sharding of ``module``, the network the stand-ins ``pending`` belong to.
    FSDP2 (no ``place``): the stand-ins become meta tensors that ``fully_shard`` shards empty, then
    each process reads its shard (:func:`fill`). ZeRO-3: ``place`` makes each stand-in a
    partitioned parameter on entering (:func:`partition`); DeepSpeed then takes the module as
    built partitioned (as under ``deepspeed.zero.Init``)."""
    if place is not None:
        partition(pending, place)
        yield
        return
    to_meta(pending)
    yield
    fill(pending, shard_device(module, device))


def partition(pending: Sequence[StandIn], place: Callable[[torch.nn.Parameter, FlatReader], None]) -> None:
    """DeepSpeed ZeRO-3, before ``prepare``: ``place(param, read)`` (the launch's) turns each stand-in
    into a partitioned parameter that holds this process's flat partition only, which it reads with
    ``read(start, stop)``: the elements ``start:stop`` of the flattened weight, in the stand-in's
    dtype. Each weight is read from its file by the rows that hold those elements (at most two rows
    more than the partition)."""
    with torch.no_grad():
        for f, item in _opened(pending):
            param = getattr(item.owner, item.attr)
            place(param, FlatReader(f, item.key, tuple(param.shape), item.dtype))


@attrs.frozen
class FlatReader:
    """The elements ``start:stop`` of one weight of an open safetensors file, flattened, cast to ``dtype``."""

    file: Any  # safe_open's handle
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        if not self.shape:  # a scalar: its one element
            return self.file.get_tensor(self.key).reshape(-1)[start:stop].to(self.dtype)
        row = math.prod(self.shape[1:])
        if stop <= start or row == 0:
            return torch.empty(0, dtype=self.dtype)
        first, last = start // row, -(-stop // row)
        rows = self.file.get_slice(self.key)[first:last].reshape(-1)
        return rows[start - first * row : stop - first * row].to(self.dtype)


def shard_device(module: torch.nn.Module, default: torch.device | str) -> torch.device | str:
    """Where the launch keeps ``module``'s shards: those of its trainable (LoRA) weights that are not
    stand-ins (the accelerator, or the CPU when FSDP offloads them); else ``default`` (full
    fine-tuning: every weight is a stand-in)."""
    for p in module.parameters():
        device = p.to_local().device if hasattr(p, "to_local") else p.device
        if p.requires_grad and device.type != "meta":
            return device
    return default


def _swap_local(param: Any, local: torch.Tensor) -> None:
    """Give the DTensor parameter ``param`` the local shard ``local``, in place: FSDP keeps the
    parameter object."""
    from torch.distributed.tensor import DTensor

    value = DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    torch.utils.swap_tensors(param, torch.nn.Parameter(value, requires_grad=param.requires_grad))


def _local_rows(param: Any) -> tuple[torch.Tensor, int]:
    """(this process's shard, its first row in the whole tensor) of an FSDP2 parameter."""
    from torch.distributed.tensor import Shard

    if tuple(param.placements) != (Shard(0),):
        raise RuntimeError(f"expected an FSDP2 parameter sharded on dim 0; got placements {param.placements}")
    rows = param.shape[0]
    chunk = math.ceil(rows / param.device_mesh.size())
    start = param.device_mesh.get_local_rank() * chunk
    local = param.to_local()
    if local.shape[0] != max(0, min(chunk, rows - start)):
        raise RuntimeError(f"a shard of {local.shape[0]} rows of {rows} at row {start}: not torch.chunk's")
    return local, start


def load(policy: Any, sharded: Sequence[str]) -> tuple[Any, list[StandIn]]:
    """The policy's pipeline with its ``sharded`` networks as stand-ins (the others as
    ``from_pretrained`` loads them, on the host), and the weights still to read; without
    ``sharded`` networks the plain whole load."""
    from fgrpo.models import _diffusers as dx

    if not sharded:
        return dx.load_pipeline(policy.pipeline_class_name, policy.path, policy._torch_dtype), []
    folder = pipeline_folder(policy.path, policy.pipeline_class())
    built: dict[str, Any] = {}
    pending: list[StandIn] = []
    for name in sharded:
        made = stand_in_model(folder, name, policy._torch_dtype, policy.device)
        if made is not None:
            built[name] = made[0]
            pending += made[1]
    return dx.load_pipeline(policy.pipeline_class_name, str(folder), policy._torch_dtype, **built), pending


def pipeline_folder(path: str, pipeline_class: Any, key: str = "model.path") -> Path:
    """The local folder of a pipeline: the folder itself, or the hub cache's snapshot of an id
    (downloaded as ``pipeline_class.from_pretrained`` would)."""
    from fgrpo.core.hub import pretrained_source

    source = pretrained_source(path, key=key)
    return Path(source.location) if source.local else Path(pipeline_class.download(source.location, **source.kwargs))
