"""A shipped recipe's backbone at its real size with random weights, on a real device, for
``tools/gpu/bench_real_size.py``: the same pieces ``fgrpo memory`` builds on fake tensors
(:mod:`fgrpo.models.fake_size`: the backbone's tiny pipeline, its trained transformer(s) swapped
for ones built from the published config, the text encoders' outputs stood in at their real
shapes, the text encoder and VAE weights as flat tensors of their published counts where the load
plan puts them on the accelerator), here as real tensors; then the recipe's own sampler's rollout
of one process's prompts, one update micro-batch (forward, backward, AdamW's step) and the
checkpoint gather, each phase timed and its ``torch.cuda.max_memory_allocated`` read: the phases
``fgrpo memory`` reports, so the two figures sit side by side.

``shrink`` builds the same code path small enough for a CPU: the transformer's sizes (every integer
and integer list of its config) are the tiny pipeline's, and the run is one prompt of two samples
at 64 px (5 frames for video)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from fgrpo.models import fake_size

#: the run a shrunk check makes of a recipe (recipe keys; each only where the recipe has the section)
SHRUNK_RUN = {
    "model.resolution": 64,
    "train.group_size": 2,
    "train.prompts_per_iteration": 1,
    "train.rollout_prompts": 1,
    "train.micro_batch_size": 1,
}
#: video backbones: the fewest frames their VAE takes (4 k + 1)
SHRUNK_FRAMES = 5
PHASES = ("load", "rollout", "update", "gather")
#: lengths of position tables (not sizes of the network): a shrunk config keeps the published ones,
#: which the prompt's and image's positions index (Z-Image's caption positions pass the tiny 256)
POSITION_KEYS = ("axes_lens", "pos_embed_max_size", "rope_max_seq_len", "sample_size")


def real_recipes(folder: Path) -> list[Path]:
    """The recipes under ``folder`` whose model is a diffusers backbone with a fake-size harness."""
    import yaml

    return sorted(
        p
        for p in folder.glob("*.yaml")
        if ((yaml.safe_load(p.read_text()) or {}).get("model") or {}).get("name") in fake_size.TINY
    )


def one_per_checkpoint(paths: list[Path]) -> list[Path]:
    """The first recipe of each (backbone, checkpoint): every real transformer once."""
    import yaml

    seen: dict[tuple[str, str], Path] = {}
    for path in paths:
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        seen.setdefault((str(model.get("name")), str(model.get("path"))), path)
    return list(seen.values())


def shrunk_overrides(data: Mapping[str, Any]) -> list[str]:
    """``KEY=VALUE`` overrides of :data:`SHRUNK_RUN` for this recipe (frames where it has them; an
    editing recipe's sources at the output's size)."""
    out = [f"{k}={v}" for k, v in SHRUNK_RUN.items()]
    model = data.get("model") or {}
    if "num_frames" in model:
        out.append(f"model.num_frames={SHRUNK_FRAMES}")
    if "source_resolution" in model:
        out.append("model.source_resolution=output")
    return out


def shrunk_config(config: Mapping[str, Any], tiny: Mapping[str, Any]) -> dict[str, Any]:
    """The published config with every size (integer, integer list) the tiny transformer's: its
    layer counts, heads and widths; flags, names and position tables (:data:`POSITION_KEYS`) stay
    the published ones."""

    def size(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return all(size(v) for v in value)
        return isinstance(value, int) and not isinstance(value, bool)

    return {
        k: tiny[k] if k in tiny and k not in POSITION_KEYS and size(v) and size(tiny[k]) else v
        for k, v in config.items()
    }


@attrs.define
class Built:
    """The policy and what the build made: flat stand-in weights, the transformers' config sources."""

    policy: Any
    flat: dict[str, torch.Tensor]
    sources: dict[str, str]
    parameters: int


def _standin_class(cls: Any) -> Any:
    """``cls`` with the text encoders' outputs stood in by random tensors of their real shapes."""

    def _encode_uncached(self: Any, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        out = {}
        for key, (shape, dtype) in self._fake_text_shapes.items():
            if dtype.is_floating_point:
                out[key] = torch.randn((len(prompts), *shape), device=device).to(dtype)
            else:  # masks and ids: all tokens kept (the longest prompt)
                out[key] = torch.ones((len(prompts), *shape), dtype=dtype, device=device)
        return out

    return type(f"RealSize{cls.__name__}", (cls,), {"_encode_uncached": _encode_uncached})


def build(model: Mapping[str, Any], device: torch.device, shrink: bool) -> Built:
    """The recipe's policy (its checked ``model`` keys) on ``device`` with real-size random
    transformers (``shrink``: the tiny sizes), placed as ``fgrpo memory`` places them."""
    from fgrpo.core import registry

    keys = dict(model)
    name, path = keys.pop("name"), str(keys["path"])
    cls = registry.load("model", name)
    tiny = fake_size.tiny_pipeline(name, path)
    checked = {k: v for k, v in keys.items() if k not in ("path", "lora_path", "device")}
    policy = _standin_class(cls).from_pipeline(tiny, path=path, device=str(device), **checked)
    fake_size.record_text_shapes(policy)
    placements = {p.name: p for p in fake_size._placements(policy, "ddp")}
    trained = {n for n, _ in policy.trained_transformers()}
    configs = transformer_configs(cls, path, policy.pipeline, shrink)
    real: dict[str, Any] = {}
    small_config: dict[str, Any] = {}
    for attr, (config, _) in configs.items():
        small = getattr(policy.pipeline, attr)
        small_config = dict(small.config)
        with torch.device(device), _default_dtype(placements[attr].dtype):
            big = type(small)(**config).to(placements[attr].dtype)
        big.requires_grad_(False)
        if attr in trained:
            policy.make_trainable(big)
        setattr(policy.pipeline, attr, big)
        fake_size._swap_held(policy, small, big)
        real = dict(big.config)
    fake_size._text_shapes_after(policy, small_config, real)
    parameters = sum(p.numel() for a in ("transformer", "transformer_2") for p in _params(policy.pipeline, a))
    sources = {attr: source for attr, (_, source) in configs.items()}
    return Built(policy, _flat_weights(policy, cls, path, placements, device, shrink), sources, parameters)


def transformer_configs(cls: Any, path: str, pipeline: Any, shrink: bool) -> dict[str, tuple[dict[str, Any], str]]:
    """{pipeline attribute: (the config to build, where it comes from)} of each transformer of the
    tiny ``pipeline``: ``fgrpo memory``'s (:func:`fgrpo.models.fake_size.transformer_config`) over
    the class defaults, with ``shrink`` the tiny sizes (:func:`shrunk_config`)."""
    found = {}
    for attr in ("transformer", "transformer_2"):
        small = getattr(pipeline, attr, None)
        if small is None:
            continue
        config, source = fake_size.transformer_config(cls, path, small)
        # published keys over the class defaults (a checkpoint the defaults are: FLUX.2 [dev], Z-Image)
        config = {**_defaults(type(small)), **fake_size._structure(dict(small.config)), **config}
        found[attr] = (shrunk_config(config, dict(small.config)) if shrink else config, source)
    return found


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Weights made in the load dtype: a float32 build first would need twice the memory (FLUX.2
    [dev]'s 32B parameters: 129 GB) before the cast."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _defaults(cls: type) -> dict[str, Any]:
    import inspect

    found = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {p.name: p.default for p in found if p.default is not inspect.Parameter.empty}


def _params(pipeline: Any, attr: str) -> list[torch.nn.Parameter]:
    module = getattr(pipeline, attr, None)
    return list(module.parameters()) if module is not None else []


def _flat_weights(
    policy: Any, cls: Any, path: str, placements: Mapping[str, Any], device: torch.device, shrink: bool
) -> dict[str, torch.Tensor]:
    """The text encoders' and VAE's published weights as one flat tensor each on the accelerator
    (where the load plan puts them there), as ``fgrpo memory`` counts them; none when shrunk."""
    known = cls.published.get(path)
    if shrink or known is None:
        return {}
    flat = {}
    for name, place in placements.items():
        if name.startswith("transformer") or place.role != "accelerator":
            continue
        if name != "vae" and name != policy.text_encoder_names[0]:
            continue  # the published count covers all text encoders: one flat tensor
        flat[name] = torch.empty(int(known.vae if name == "vae" else known.text), dtype=place.dtype, device=device)
    return flat


@attrs.define
class Phase:
    seconds: float
    peak: int | None  #: torch.cuda.max_memory_allocated over the phase (None off CUDA)


class _Timed:
    """A phase: synchronised wall time and the CUDA allocator's peak over it."""

    def __init__(self, device: torch.device, into: dict[str, Phase], name: str) -> None:
        self.device, self.into, self.name = device, into, name

    def __enter__(self) -> None:
        from fgrpo.core import timing

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        timing.synchronize(self.device)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        from fgrpo.core import timing

        timing.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        self.into[self.name] = Phase(time.perf_counter() - self.t0, peak)


def run(data: Mapping[str, Any], gpus: int, device: torch.device, shrink: bool) -> tuple[Built, dict[str, Phase]]:
    """Load, one process's rollout (``gpus`` processes share the recipe's prompts), one update
    micro-batch with AdamW's step and the checkpoint gather, as ``fgrpo.models.memory.measure`` runs
    them on fake tensors; each phase timed, with its allocator peak."""
    from fgrpo.core import registry

    phases: dict[str, Phase] = {}
    train, sampler_spec = dict(data["train"]), dict(data["sampler"])
    with _Timed(device, phases, "load"):
        built = build(data["model"], device, shrink)
        policy = built.policy
        trainable = [p for p in policy.trainable_parameters() if p.requires_grad]
        # the EMA's float32 copy of what trains (fgrpo.core.ema), held from the start
        ema = [p.detach().float().clone() for p in trainable] if float(train.get("ema_decay") or 0) > 0 else []
    sampler = registry.create(
        "sampler", sampler_spec["name"], **{k: v for k, v in sampler_spec.items() if k != "name"}
    )
    prompts_here = max(int(train.get("prompts_per_iteration", 8)) // gpus, 1)
    chunk = int(train.get("rollout_prompts") or 0) or prompts_here
    group, micro = int(train.get("group_size", 8)), int(train.get("micro_batch_size") or 1)
    with _Timed(device, phases, "rollout"), torch.no_grad():
        trajectories = [
            sampler.rollout(policy, fake_size.prompts(policy, min(chunk, prompts_here - start)), group)
            for start in range(0, prompts_here, chunk)
        ]
    traj = trajectories[0]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    with _Timed(device, phases, "update"):
        if traj.latents.shape[1]:  # a step of the rollout
            x, sigma = traj.latents[:micro, 0], traj.sigmas[traj.step_index[:micro, 0]]
        else:  # forward-process objectives (NFT, AWM) train on the final samples, noised at a drawn time
            x, sigma = traj.final[:micro], traj.sigmas[len(traj.sigmas) // 2]
        cond = {k: v[:micro] for k, v in traj.cond.items() if isinstance(v, torch.Tensor)}
        policy.velocity(x, sigma, cond).float().square().mean().backward()
        optimizer.step()
    with _Timed(device, phases, "gather"):
        policy.trainable_state_dict()
    del ema
    return built, phases
