"""A diffusers backbone at its real size on fake tensors (``FakeTensorMode``: shapes and dtypes, no
storage), for ``fgrpo memory``: the recipe's policy class drives a pipeline whose trained
transformer(s) are built from the published ``config.json`` on the meta device and materialised as
fake tensors where the load plan places them; everything the policy computes (velocity, guidance,
packing, LoRA, gradient checkpointing) is its own code.

What the harness stands in for, and why (the CPU build of torch cannot run these under fake mode):

- devices: fake tensors on ``cuda`` stand for the accelerator, on ``cpu`` for the host; a move
  between them (``Tensor.to``) makes an empty fake tensor on the target (the CPU build refuses the
  copy); ``nn.Module.to`` replaces fake parameters instead of swapping them in place;
- ``torch.autocast("cuda")``: a no-op (activations stay in the weights' dtype: an upper bound);
- text encoders and VAE: their weights as one flat tensor of the published parameter count (no
  config is shipped for them), their outputs as tensors of the real shapes (the tiny pipeline's
  output with the real transformer's widths); VAE decoding is not run (formula).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

#: fake tensors on the CPU stand for the accelerator's, fake ``meta`` tensors for the host's
ACCELERATOR = torch.device("cpu")
HOST = torch.device("meta")
#: transformer config keys that carry the text encoders' widths (the stand-in embeddings take them)
TEXT_WIDTH_KEYS = (
    "joint_attention_dim",
    "text_dim",
    "cap_feat_dim",
    "text_embed_dim",
    "text_embed_2_dim",
    "image_embed_dim",
    "context_in_dim",
    "pooled_projection_dim",
)
#: the tiny builder of each backbone (fgrpo.models.testing.pipelines) and its arguments
TINY = {
    "sd3": ("sd3", {"sd35": True}),
    "flux": ("flux", {}),
    "flux-kontext": ("flux_kontext", {}),
    "flux2": ("flux2", {}),
    "flux2-klein": ("flux2_klein", {}),
    "qwen-image": ("qwen_image", {}),
    "qwen-image-edit": ("qwen_image_edit", {}),
    "wan": ("wan", {}),
    "wan-i2v": ("wan22_i2v", {}),
    "z-image": ("z_image", {}),
    "hunyuan-video-1.5": ("hunyuan_video15", {}),
}
#: Wan 2.2 A14B checkpoints: two experts (transformer, transformer_2)
TWO_EXPERT_BUILDERS = {"Wan-AI/Wan2.2-T2V-A14B-Diffusers": "wan22", "Wan-AI/Wan2.2-I2V-A14B-Diffusers": "wan22_i2v"}


@attrs.frozen
class Placement:
    """Where the load plan puts a module: ``role`` accelerator or host, in ``dtype``, ``sharded``
    over the processes (the trained transformer under FSDP2 / ZeRO-3)."""

    name: str
    role: str
    dtype: torch.dtype
    sharded: bool


def _placements(policy: Any, launch: str) -> list[Placement]:
    """The load placement of ``policy``'s modules under ``launch`` (the semantics of
    ``fgrpo.models.load_plan.plan``, which replaces this function when it lands)."""
    from fgrpo.core.launch.memory import shards_weights

    sharded = shards_weights(launch)
    found = [Placement(name, "accelerator", policy._torch_dtype, sharded) for name, _ in policy.trained_transformers()]
    frozen = [n for n in ("transformer", "transformer_2") if getattr(policy.pipeline, n, None) is not None]
    found += [
        Placement(n, "accelerator", policy._torch_dtype, False) for n in frozen if n not in {p.name for p in found}
    ]
    # the recipe's text_encoder_device ("cpu": the host); the policy itself runs on the accelerator's stand-in
    text_role = "host" if str(policy.text_encoder_device or "").startswith("cpu") else "accelerator"
    text_dtype = _dtype(policy.text_encoder_dtype, policy._torch_dtype)
    found += [Placement(n, text_role, text_dtype, False) for n in policy.text_encoder_names]
    found.append(Placement("vae", "accelerator", _dtype(policy.vae_dtype, policy._torch_dtype), False))
    return found


def _dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    from fgrpo.models import _diffusers as dx

    return dx.parse_dtype(name) if name is not None else default


# --- the fake runtime ----------------------------------------------------------------------------


_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.tensor,
    torch.as_tensor,
    torch.randint,
    torch.randperm,
    torch.rand,
}
#: a factory of at most this many values makes real numbers (a schedule, step indices, a probe),
#: which the samplers read; larger ones (states, embeddings, storage) are fake
SMALL = 4096
_GRAD_HOOKS = (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)


class _NoHook:
    def remove(self) -> None:
        pass


class _Devices(torch.overrides.TorchFunctionMode):
    """Where tensors stand: ``cuda`` means the accelerator, which fake ``cpu`` tensors stand for
    (the CPU build of torch runs no ``cuda`` tensor, fake or not); the host's placements are fake
    ``meta`` tensors (never computed on); small host numbers stay real (see :data:`SMALL`)."""

    #: tensors made now are fake whatever their size (the load plan's placements)
    placing = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._pytree import tree_leaves, tree_map

        kwargs = kwargs or {}
        if func in _GRAD_HOOKS and not args[0].requires_grad:
            return _NoHook()  # MemTracker hooks every parameter's gradient; frozen ones have none
        if func is torch.Tensor.cuda:
            func, args = torch.Tensor.to, (args[0], ACCELERATOR, *args[1:])
        args, kwargs = tree_map(_accelerator, (args, kwargs))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.Tensor.to and tensors and tensors[0].device == HOST:
            target = _target_device(args[1:], kwargs)
            if target is not None and target != HOST:  # from the host's placements: a fake copy
                dtype = _target_dtype(args[1:], kwargs) or tensors[0].dtype
                return torch.empty(tensors[0].shape, dtype=dtype, device=ACCELERATOR)
        if func is torch.Tensor.__getitem__ and _masked_by_real(args):
            # a real boolean mask (a prompt's tokens) picks rows of a fake tensor: its real indices
            # give the shape a fake mask cannot
            with unset_fake_temporarily():
                rows = args[1].nonzero().squeeze(1)
            return args[0].index_select(0, rows)
        if not self.placing and _real_numbers(func, args, kwargs, tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _masked_by_real(args: Any) -> bool:
    return (
        len(args) == 2
        and _is_fake(args[0])
        and isinstance(args[1], torch.Tensor)
        and not _is_fake(args[1])
        and args[1].dtype == torch.bool
        and args[1].ndim == 1
    )


def _accelerator(value: Any) -> Any:
    """``cuda`` (a device argument) -> the accelerator's stand-in."""
    if isinstance(value, torch.device) and value.type == "cuda":
        return ACCELERATOR
    if isinstance(value, str) and value.startswith("cuda"):
        return ACCELERATOR
    return value


def _real_numbers(func: Any, args: Any, kwargs: Mapping[str, Any], tensors: list[torch.Tensor]) -> bool:
    """A small factory on the accelerator's stand-in, or an op on real tensors only."""
    if tensors:
        return not any(_is_fake(t) or t.device.type != "cpu" for t in tensors)
    if func not in _FACTORIES or _target_device((), kwargs) not in (None, ACCELERATOR):
        return False
    return _numel(func, args, kwargs) <= SMALL


def _numel(func: Any, args: Any, kwargs: Mapping[str, Any]) -> int:
    if func in (torch.tensor, torch.as_tensor):
        import numpy as np

        return int(np.size(args[0])) if args else 0
    if func in (torch.arange, torch.linspace, torch.randperm):
        return SMALL  # schedules, step counts and their random subsets
    size = kwargs.get("size", args[2] if func is torch.randint and len(args) > 2 else args[0] if args else ())
    if func is torch.full:
        size = args[0] if args else kwargs.get("size", ())
    if isinstance(size, int):
        size = (size,) + tuple(a for a in args[1:] if isinstance(a, int))
    count = 1
    for dim in size if isinstance(size, (tuple, list, torch.Size)) else ():
        count *= int(dim)
    return count


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _target_device(rest: tuple, kwargs: Mapping[str, Any]) -> torch.device | None:
    for value in (*rest, kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
    return None


def _target_dtype(rest: tuple, kwargs: Mapping[str, Any]) -> torch.dtype | None:
    for value in (*rest, kwargs.get("dtype")):
        if isinstance(value, torch.dtype):
            return value
    return None


def _fake_apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
    """``nn.Module._apply`` that replaces parameters instead of swapping them (fake tensors refuse
    ``swap_tensors``): what ``.to``, ``.float`` and ``.to_empty`` do, on fake modules."""
    if recurse:
        for module in self.children():
            _fake_apply(module, fn)
    for key, param in self._parameters.items():
        if param is not None:
            with torch.no_grad():
                applied = fn(param)
            if applied is not param:
                self._parameters[key] = torch.nn.Parameter(applied, param.requires_grad)
    for key, buf in self._buffers.items():
        if buf is not None:
            self._buffers[key] = fn(buf)
    return self


def _autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
    if device_type == "cuda":
        return contextlib.nullcontext()
    return _REAL_AUTOCAST(device_type, *args, **kwargs)


_REAL_AUTOCAST = torch.autocast


@contextlib.contextmanager
def fake_runtime() -> Iterator[Any]:
    """Fake tensor mode with the stand-ins above; yields the mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    original = torch.nn.Module._apply
    torch.nn.Module._apply = _fake_apply  # type: ignore[method-assign]
    torch.autocast = _autocast  # type: ignore[misc,assignment]
    try:
        with mode, _Devices():
            yield mode
    finally:
        torch.nn.Module._apply = original  # type: ignore[method-assign]
        torch.autocast = _REAL_AUTOCAST  # type: ignore[misc]


# --- the real-size policy ------------------------------------------------------------------------


def transformer_config(cls: Any, path: str, small: Any) -> tuple[dict[str, Any], str]:
    """The real transformer's config and where it comes from: the published ``config.json`` the
    backbone ships (``Published.config``), else the diffusers class defaults when their parameter
    count is the published one (within 3 %); a path the backbone does not publish: the tiny
    pipeline's own (tests)."""
    transformer_class = type(small)
    known = cls.published.get(path)
    if known is None:
        return {k: v for k, v in small.config.items() if not k.startswith("_")}, "the tiny pipeline's (not published)"
    if known is not None and known.config is not None:
        return dict(known.config), known.source or "published config.json"
    with torch.device("meta"):
        count = sum(p.numel() for p in transformer_class().parameters())
    if known is not None and abs(count - known.transformer) <= 0.03 * known.transformer:
        return {}, f"diffusers {transformer_class.__name__} defaults ({count / 1e9:.2f}B parameters, as published)"
    raise ValueError(
        f"model.path {path!r}: no published transformer config for {cls.__name__}, and the diffusers defaults "
        f"({count / 1e9:.2f}B) are not its published size"
    )


def tiny_pipeline(name: str, path: str) -> Any:
    from fgrpo.models.testing import pipelines

    kind, kwargs = TINY[name]
    kind = TWO_EXPERT_BUILDERS.get(path, kind)
    return pipelines.builders()[kind](**kwargs)


def _standin_class(cls: Any) -> Any:
    """``cls`` with the text encoders' outputs stood in (real shapes, no encoder run)."""

    def _encode_uncached(self: Any, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        out = {}
        for k, (shape, dtype) in self._fake_text_shapes.items():
            if dtype.is_floating_point:
                with placing():
                    out[k] = torch.zeros((len(prompts), *shape), dtype=dtype, device=ACCELERATOR)
            else:  # masks and ids: values the backbone reads (all tokens kept: the longest prompt)
                with unset_fake_temporarily():
                    out[k] = torch.ones((len(prompts), *shape), dtype=dtype, device=ACCELERATOR)
        return out

    def sigmas(self: Any, steps: int) -> torch.Tensor:
        # the schedule is data (the sampler reads its values): real numbers on the host, which fake
        # tensors on the accelerator take as scalars
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            return cls.sigmas(self, steps)

    @contextlib.contextmanager
    def shard_loading(self: Any) -> Iterator[None]:
        # the launch's sharded load (DiffusersPolicy.shard_loading) with the shards allocated, not read
        from fgrpo.core.launch.memory import sharding_on_meta

        with sharding_on_meta(stand_ins_to_meta(self._stand_ins)):
            yield
            fill_shards(self._stand_ins, ACCELERATOR)
        self._stand_ins = []

    members = {"_encode_uncached": _encode_uncached, "sigmas": sigmas, "shard_loading": shard_loading}
    return type(f"RealSize{cls.__name__}", (cls,), members)


def real_size_policy(name: str, keys: Mapping[str, Any], launch: str) -> tuple[Any, dict[str, Any]]:
    """The recipe's policy (model ``name``, checked ``keys``) around a tiny pipeline whose trained
    transformers are swapped for real-size fake ones; call inside :func:`fake_runtime`... after
    building (the tiny pipeline is built outside). Returns (policy, notes)."""
    from fgrpo.core import registry

    cls = registry.load("model", name)
    path = str(keys["path"])
    tiny = tiny_pipeline(name, path)
    checked = {k: v for k, v in keys.items() if k not in ("path", "lora_path", "device")}
    policy = _standin_class(cls).from_pipeline(tiny, path=path, device="cpu", **checked)
    return policy, {"tiny": tiny}


def meta_transformers(policy: Any, launch: str) -> dict[str, tuple[Any, str]]:
    """Outside fake mode (nothing counted): the real-size transformers on the meta device in their
    load dtype, with where their config comes from, by pipeline attribute."""
    cls: Any = type(policy).__mro__[1]
    placements = {p.name: p for p in _placements(policy, launch)}
    found = {}
    for attr in ("transformer", "transformer_2"):
        small = getattr(policy.pipeline, attr, None)
        if small is not None:
            config, source = transformer_config(cls, str(policy.path), small)
            with torch.device("meta"):
                big = type(small)(**{**_structure(small.config), **config}).to(placements[attr].dtype)
            found[attr] = (big, source)
    return found


def materialise(policy: Any, name: str, launch: str, metas: Mapping[str, tuple[Any, str]]) -> dict[str, Any]:
    """Inside :func:`fake_runtime`: the transformers of :func:`meta_transformers`, text encoder and
    VAE weights placed as :func:`_placements` says; returns what it built (flat weights, sources)."""

    cls: Any = type(policy).__mro__[1]
    placements = {p.name: p for p in _placements(policy, launch)}
    trained = {n for n, _ in policy.trained_transformers()}
    # what the FSDP2 launch loads shard by shard (the load plan's; full fine-tuning loads whole)
    from fgrpo.core.launch.memory import runs_sharding

    by_shards = {p.name for p in policy.load_plan(shards=True) if p.sharded} if runs_sharding(launch) else set()
    built: dict[str, Any] = {"sources": {}, "flat": {}}
    real_config: dict[str, Any] = {}
    tiny_config: dict[str, Any] = {}
    for attr in ("transformer", "transformer_2"):
        small = getattr(policy.pipeline, attr, None)
        if small is None:
            continue
        big, source = metas[attr]
        place = placements[attr]
        device = ACCELERATOR if place.role == "accelerator" else HOST
        if attr in by_shards:  # loaded as the launch loads it: stand-ins, sharded later
            big.requires_grad_(False)
            policy._stand_ins += stand_ins(big, device)
        else:
            with placing():
                big.to_empty(device=device)
        big.requires_grad_(False)
        if attr in trained:
            policy.make_trainable(big)
        setattr(policy.pipeline, attr, big)
        _swap_held(policy, small, big)
        built["sources"][attr] = source
        real_config, tiny_config = dict(big.config), dict(small.config)
    built["text_shapes"] = _text_shapes_after(policy, tiny_config, real_config)
    known = cls.published.get(str(policy.path))
    for name_, place in placements.items():
        if name_.startswith("transformer") or known is None:
            continue
        count = known.vae if name_ == "vae" else known.text
        if name_ != "vae" and name_ != policy.text_encoder_names[0]:
            continue  # the published count covers all text encoders: one flat tensor
        device = ACCELERATOR if place.role == "accelerator" else HOST
        built["flat"][name_] = _fake_empty(int(count), place.dtype, device)
    policy.device = ACCELERATOR
    return built


@contextlib.contextmanager
def placing() -> Iterator[None]:
    """Tensors made inside are fake whatever their size (weights, the text stand-ins)."""
    from torch.overrides import _get_current_function_mode_stack

    mode = next(m for m in _get_current_function_mode_stack() if isinstance(m, _Devices))
    mode.placing = True
    try:
        yield
    finally:
        mode.placing = False


def _swap_held(policy: Any, small: torch.nn.Module, big: torch.nn.Module) -> None:
    """Where the policy holds the transformer besides its pipeline (Wan 2.2's experts module)."""
    for field in attrs.fields(type(policy)):
        holder = getattr(policy, field.name, None)
        if isinstance(holder, torch.nn.Module) and holder is not small and holder is not big:
            for module in holder.modules():
                for key, child in list(module._modules.items()):
                    if child is small:
                        module._modules[key] = big


def _fake_empty(count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:

    with placing():
        return torch.empty(count, dtype=dtype, device=device)


def _text_shapes_after(policy: Any, tiny: Mapping[str, Any], real: Mapping[str, Any]) -> dict[str, Any]:
    shapes = policy._fake_text_shapes_pending
    out = {}
    for key, (dims, dtype) in shapes.items():
        dims = list(dims)
        order: tuple[str, ...] = TEXT_WIDTH_KEYS[::-1] if len(dims) == 1 else TEXT_WIDTH_KEYS
        # a second encoder's output (HunyuanVideo 1.5's ByT5: prompt_embeds_2) takes the second width
        # first: tiny widths may coincide
        order = tuple(sorted(order, key=lambda k: ("_2" in k) != ("_2" in key)))
        width = next((k for k in order if tiny.get(k) == dims[-1] and k in real), None)
        if width is not None:
            dims[-1] = int(real[width])
        out[key] = (tuple(dims), dtype)
    policy._fake_text_shapes = out
    return out


class SourceImage:
    """A source image of the recipe's size (editing backbones), as ``fgrpo.core.media`` reads one."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.size = size

    def to_pil(self) -> Any:
        from PIL import Image

        return Image.new("RGB", (self.size[1], self.size[0]))


def prompts(policy: Any, count: int) -> list[str]:
    """``count`` prompts with the fewest source images the backbone takes (none for text-to-image)."""
    from fgrpo.core.media import Prompt

    least = int(getattr(policy, "source_image_count", (0, 0))[0])
    image = SourceImage(tuple(policy.size))
    return [Prompt(f"prompt {i}", images=(image,) * least) for i in range(count)]


def record_text_shapes(policy: Any) -> None:
    """Outside fake mode: the tiny encoders' output shapes (batch dropped)."""
    layers = getattr(policy, "text_encoder_out_layers", None)
    if layers is not None:  # FLUX.2 stacks 3 hidden layers; the tiny encoder has 2 (3 x its width either way)
        policy.text_encoder_out_layers = [1, 2, 2]
    try:
        backbone: Any = type(policy).__mro__[1]  # the recipe's class, under the stand-in
        out = backbone._encode_uncached(policy, prompts(policy, 1), policy.text_device)
    finally:
        if layers is not None:
            policy.text_encoder_out_layers = layers
    policy._fake_text_shapes_pending = {k: (tuple(v.shape[1:]), v.dtype) for k, v in out.items()}


#: config keys that follow the checkpoint's kind, not its size (kept from the tiny pipeline's
#: transformer when the published config does not give them: an image-to-video input's channels)
STRUCTURE_KEYS = ("in_channels", "out_channels", "guidance_embeds")


def _structure(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in STRUCTURE_KEYS if k in config}


# --- the sharded load (fgrpo.models.sharded_load) on fake tensors ----------------------------------


def stand_ins(module: torch.nn.Module, device: torch.device) -> list[Any]:
    """Inside fake mode: ``module``'s (on meta) weights as the sharded load's zero-stride stand-ins on
    ``device``, its buffers allocated there; returns them as :class:`sharded_load.StandIn`."""
    from pathlib import Path

    from fgrpo.models import sharded_load

    pending = []
    with placing():
        for key, param in list(module.named_parameters()):
            owner, attr = sharded_load._owner(module, key)
            blank = torch.zeros((), dtype=param.dtype, device=device).expand(param.shape)
            owner._parameters[attr] = torch.nn.Parameter(blank, requires_grad=False)
            pending.append(sharded_load.StandIn(owner, attr, key, Path("(fake)"), param.dtype))
        for owner in module.modules():
            for attr, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[attr] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return pending


def stand_ins_to_meta(pending: list[Any]) -> dict[int, torch.nn.Parameter]:
    """:func:`sharded_load.to_meta` for fake stand-ins: fake tensors are weakly referenced by their
    mode, which ``swap_tensors`` refuses, so each is replaced rather than swapped in place; returns
    {id of the replaced parameter: its replacement}, for the optimizer that holds the old ones
    under full fine-tuning."""
    replaced = {}
    for item in pending:
        param = getattr(item.owner, item.attr)
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        replaced[id(param)] = item.owner._parameters[item.attr] = torch.nn.Parameter(
            meta, requires_grad=param.requires_grad
        )
    return replaced


def fill_shards(pending: list[Any], device: torch.device) -> None:
    """Inside fake mode, once sharded: this process's shard of each stand-in, allocated on ``device``
    (what :func:`sharded_load.fill` reads from the files)."""
    from fgrpo.models import sharded_load

    for item in pending:
        param = getattr(item.owner, item.attr)
        local, _ = sharded_load._local_rows(param)
        with placing():
            shard = torch.empty(local.shape, dtype=local.dtype, device=device)
        sharded_load._swap_local(param, shard)
