"""``trajectory``: a flow-matching planner over (T, 2) or (T, 3) waypoints, conditioned on a scene.

The generated sample is a plan: ``horizon`` waypoints at ``dt`` s, 2 dt, ... in the ego's frame
(x forward, y left, metres; with ``dims: 3`` also the heading, radians). The network works in a
normalised space where a plan is a few numbers of order one: waypoint k's x becomes its mean
speed to there, (x_k / t_k - speed_offset) / speed_scale, its y becomes y_k / lateral_scale (the
heading heading / heading_scale). Noise of a given size in that space is small for near waypoints
and grows with the horizon in metres, the scale a plan's uncertainty has. ``decode`` returns
metres.

The scene encoding comes from the prompt source that names the scenes (``scenes``, a registered
``fgrpo.prompts`` name whose class offers ``encode_prompts(prompts) -> (B, F)`` and
``check_prompts(prompts) -> [problem]``): for the driving world, 38 numbers (the ego's state, its
lane, the nearest cars around it). The model knows nothing else of the world.

Network: the flattened noisy plan, the scene encoding and a sinusoidal embedding of sigma, each
projected to ``hidden`` and summed, then ``blocks`` residual MLP blocks (LayerNorm, Linear to
2 x hidden, SiLU, Linear back; the scene and time embedding added before each), then a Linear to
the plan (164k parameters at hidden 112, 3 blocks). It predicts v = eps - x0.

Weights: a safetensors file with the architecture and normalisation in its metadata; the default
is the shipped behaviour-cloning base (``fgrpo/worlds/driving/weights/driving-base.safetensors``, made by
``fgrpo.worlds.driving.pretrain`` from the driving world's teacher logs). Fine-tuning: full (a frozen
copy of the base is ``reference()``) or a peft LoRA on every Linear layer (``lora: {rank: r}``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from fgrpo.core import flow, registry, seeding
from fgrpo.core.config import param
from fgrpo.models._small import SmallNet
from fgrpo.models.lora import lora_param
from fgrpo.models.vector import DTYPES, _valid_device, time_embedding

WEIGHTS_RESOURCE = "driving/weights/driving-base.safetensors"

#: what a weights file records besides its tensors (the model's architecture and normalisation)
ARCH_KEYS = (
    "horizon",
    "dims",
    "cond_dim",
    "hidden",
    "blocks",
    "time_dim",
    "dt",
    "speed_offset",
    "speed_scale",
    "lateral_scale",
    "heading_scale",
)


@attrs.frozen
class Architecture:
    horizon: int = 8
    dims: int = 2
    cond_dim: int = 38
    hidden: int = 112
    blocks: int = 3
    time_dim: int = 32
    dt: float = 0.5
    speed_offset: float = 20.0
    speed_scale: float = 10.0
    lateral_scale: float = 2.0
    heading_scale: float = 0.2

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Architecture:
        data = json.loads(text)
        return Architecture(**{k: data[k] for k in ARCH_KEYS if k in data})


class PlanVelocity(nn.Module):
    """v(x, sigma, scene) for flattened plans (see the module docstring). Linear layers are named
    ``plan_in``, ``scene_in``, ``time_in``, ``blocks.{i}.up|down`` and ``out`` (LoRA targets)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        size = arch.horizon * arch.dims
        self.arch = arch
        self.plan_in = nn.Linear(size, arch.hidden)
        self.scene_in = nn.Linear(arch.cond_dim, arch.hidden)
        self.time_in = nn.Linear(arch.time_dim, arch.hidden)
        self.blocks = nn.ModuleList(_Block(arch.hidden) for _ in range(arch.blocks))
        self.norm = nn.LayerNorm(arch.hidden)
        self.out = nn.Linear(arch.hidden, size)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        dtype = self.plan_in.weight.dtype
        context = self.scene_in(cond.to(dtype)) + self.time_in(time_embedding(sigma, self.arch.time_dim).to(dtype))
        h = self.plan_in(x.reshape(x.shape[0], -1).to(dtype)) + context
        for block in self.blocks:
            h = block(h, context)
        return self.out(nn.functional.silu(self.norm(h))).reshape(x.shape)


class _Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return h + self.down(nn.functional.silu(self.up(self.norm(h + context))))


def default_weights_path() -> str:
    from importlib.resources import files

    return str(files("fgrpo.worlds").joinpath(WEIGHTS_RESOURCE))


def save_network(network: PlanVelocity, path: str | Path, extra: Mapping[str, str] | None = None) -> None:
    """Write the network as float32 safetensors with its architecture (and ``extra`` strings, e.g.
    how it was trained) in the metadata."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in network.state_dict().items()}
    metadata = {"format": "pt", "fgrpo_model": "trajectory", "architecture": network.arch.to_json(), **(extra or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=metadata)


def load_network(path: str | Path) -> PlanVelocity:
    from safetensors import safe_open
    from safetensors.torch import load_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.path: no such file {str(file)!r} (a trajectory safetensors file)")
    with safe_open(str(file), framework="pt") as f:
        meta = dict(f.metadata() or {})
    if meta.get("fgrpo_model") != "trajectory" or "architecture" not in meta:
        raise ValueError(
            f"model.path: {str(file)!r} is not a trajectory weights file (no trajectory architecture in its metadata)"
        )
    network = PlanVelocity(Architecture.from_json(meta["architecture"]))
    state = load_file(str(file))
    expected = network.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"model.path: {str(file)!r} does not fit its own architecture: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}"
        )
    network.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return network


def _two_or_three(_instance: Any, _attribute: Any, value: Any) -> None:
    if value is not None and value not in (2, 3):
        raise ValueError(f"got {value!r}; allowed: 2 (x, y) or 3 (x, y, heading), or null for the weights file's")


@attrs.define(eq=False)
class TrajectoryPolicy:
    """A flow-matching planner: plans of ``horizon`` (x, y[, heading]) waypoints conditioned on the
    scene the prompt names (see the module docstring). ``path: null`` loads the shipped BC base;
    ``path: random`` builds a fresh network from the architecture keys (pretraining, tests)."""

    scenes: str = param(
        "driving", help="the prompt source (fgrpo.prompts name) whose encode_prompts gives the scene encoding"
    )
    path: str | None = param(
        None, help="trajectory safetensors weights; null: the shipped BC base; 'random': a new network (init seed)"
    )
    horizon: int | None = param(None, ge=1, help="waypoints per plan (null: the weights file's; 'random' default 8)")
    dims: int | None = param(
        None, validator=_two_or_three, help="2: (x, y); 3: (x, y, heading) (null: the weights file's)"
    )
    hidden: int = param(112, ge=1, help="width of a new network (path: random)")
    blocks: int = param(3, ge=1, help="residual blocks of a new network (path: random)")
    shift: float = param(1.0, gt=0, help="time shift s of the default schedule: s*t/(1+(s-1)*t)")
    lora: dict | None = lora_param(8, None, default=False)
    # torch's generators take seeds below 2**64 (init + 2 seeds the LoRA); 2**63 - 1 as every driving seed
    init: int = param(0, ge=0, le=2**63 - 1, help="seed of a new network's weights and of the LoRA init")
    dtype: str = param("float32", choices=tuple(DTYPES), help="dtype of the weights")
    device: str | torch.device = param("cpu", validator=_valid_device, help="torch device of the network")

    evaluations_per_call: int = attrs.field(default=1, init=False)
    arch: Architecture = attrs.field(init=False, default=None, repr=False)
    _net: SmallNet[PlanVelocity] = attrs.field(init=False, default=None, repr=False)
    _source: Any = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self.device = torch.device(self.device)
        self._source = registry.load("prompts", self.scenes)
        if not callable(getattr(self._source, "encode_prompts", None)):
            raise ValueError(
                f"model.scenes: the prompt source {self.scenes!r} has no encode_prompts(prompts): it names no scenes"
            )
        if self.path == "random":
            cond = int(getattr(self._source, "encoding_size", 0) or 0)
            self.arch = Architecture(
                horizon=self.horizon or 8,
                dims=self.dims or 2,
                cond_dim=cond or Architecture.cond_dim,
                hidden=self.hidden,
                blocks=self.blocks,
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.init)
                network = PlanVelocity(self.arch)
        else:
            network = load_network(self.path or default_weights_path())
            self.arch = network.arch
            wrong = [
                (k, getattr(self, k), getattr(self.arch, k))
                for k in ("horizon", "dims")
                if getattr(self, k) not in (None, getattr(self.arch, k))
            ]
            if wrong:
                raise ValueError(
                    "; ".join(
                        f"model.{k}: got {mine} but the weights have {theirs}; leave it out (null)"
                        for k, mine, theirs in wrong
                    )
                )
        network.requires_grad_(False)
        network.to(device=self.device, dtype=DTYPES[self.dtype])
        if self.lora is not None and self.lora["target_modules"] is None:
            self.lora = {
                **self.lora,
                "target_modules": [n for n, m in network.named_modules() if isinstance(m, nn.Linear)],
            }
        self._net = SmallNet(network, self.lora, seed=self.init + 2, device=self.device)

    # --- the Policy protocol --------------------------------------------------------------------

    @property
    def network(self) -> PlanVelocity:
        return self._net.trained

    def check_prompts(self, prompts: Sequence[str]) -> list[str]:
        check = getattr(self._source, "check_prompts", None)
        return list(check(list(prompts))) if check is not None else []

    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        """(B, cond_dim) float32: the scene encoding of each prompt's scene."""
        cond = torch.as_tensor(self._source.encode_prompts(list(prompts)), dtype=torch.float32)
        if cond.dim() != 2 or cond.shape[1] != self.arch.cond_dim:
            raise ValueError(
                f"the scene encoding of {self.scenes!r} has shape {tuple(cond.shape)}; the network takes (B, "
                f"{self.arch.cond_dim})"
            )
        return cond.to(self.device)

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return seeding.randn((n, self.arch.horizon, self.arch.dims), generator, self.device)

    def sigmas(self, steps: int) -> torch.Tensor:
        return flow.shifted_sigmas(steps, self.shift, self.device)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, device=x.device)
        if sigma.dim() == 0:
            sigma = sigma.expand(x.shape[0])
        out = self._net.module()(x, sigma, cond)
        return out.to(torch.float32)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, T, dims) waypoints in metres (and radians) from normalised plans."""
        return to_waypoints(latents.to(torch.float32), self.arch)

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        return self._net.parameters()

    def reference(self):
        return self._net.reference()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return self._net.state_dict()

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._net.load_state_dict(state, f"this trajectory policy (lora {self.lora})")

    # --- extras ---------------------------------------------------------------------------------

    def base_network(self) -> PlanVelocity:
        return self._net.base()

    @staticmethod
    def start_from(folder: str) -> dict[str, Any]:
        """The keys that make a new planner (a later stage of a recipe) start from what
        :meth:`export` wrote into ``folder``: its network becomes the base, and the KL's reference."""
        return {"path": str(Path(folder) / "trajectory.safetensors")}

    def export(self, folder: str, state: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """The trained network (base and adapter merged) as a trajectory weights file."""
        import copy

        if state is not None:
            saved = self.trainable_state_dict()
            self.load_trainable_state_dict(state)
        try:
            merged = self._net.merged(copy.deepcopy)
        finally:
            if state is not None:
                self.load_trainable_state_dict(saved)
        path = Path(folder) / "trajectory.safetensors"
        save_network(merged, path, extra={"exported_from": "fgrpo"})
        return [str(path)]


def to_waypoints(z: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """Normalised plans (..., T, dims) -> waypoints in metres (radians)."""
    t = torch.arange(1, arch.horizon + 1, dtype=z.dtype, device=z.device) * arch.dt
    x = (z[..., 0] * arch.speed_scale + arch.speed_offset) * t
    out = [x, z[..., 1] * arch.lateral_scale]
    if arch.dims == 3:
        out.append(z[..., 2] * arch.heading_scale)
    return torch.stack(out, -1)


def from_waypoints(w: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """Waypoints (..., T, >= dims) in metres -> normalised plans (the inverse of :func:`to_waypoints`)."""
    t = torch.arange(1, arch.horizon + 1, dtype=w.dtype, device=w.device) * arch.dt
    out = [(w[..., 0] / t - arch.speed_offset) / arch.speed_scale, w[..., 1] / arch.lateral_scale]
    if arch.dims == 3:
        out.append(w[..., 2] / arch.heading_scale)
    return torch.stack(out, -1)


__all__ = [
    "Architecture",
    "PlanVelocity",
    "TrajectoryPolicy",
    "default_weights_path",
    "from_waypoints",
    "load_network",
    "save_network",
    "to_waypoints",
]
