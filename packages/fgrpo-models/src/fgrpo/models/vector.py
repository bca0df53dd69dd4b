"""The smallest real policy: an MLP velocity field over R^dim, conditioned on a prompt's target.

Its outputs are the vectors themselves (``decode`` is the identity), which makes it the policy of
non-image uses of the method (a trajectory head in a planner is one) and of the fast offline
tests: a Flow-GRPO iteration of 8 prompts x 8 samples x 10 steps costs a few milliseconds.

Prompts map to vectors through :mod:`fgrpo.core.vectors`: ``"target 0.5 -1.0"`` asks for the
point (0.5, -1.0); any other prompt gets a fixed pseudo-random target in [-1, 1]^dim. The
conditioning the network sees starts with exactly the target the ``target-distance`` reward
checks, so RL can learn to use it; the base model ignores it (random init, or fitted to a
prompt-independent distribution with ``pretrain_steps``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from itertools import pairwise
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from fgrpo.core import flow, seeding
from fgrpo.core.config import param
from fgrpo.core.vectors import condition_vector
from fgrpo.models._small import SmallNet
from fgrpo.models.lora import lora_param

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: the time embedding uses frequencies from 1 to this many radians per unit of sigma: smooth over
#: the 10-50 steps of a schedule, unlike the 1000x timestep scale of image backbones.
_MAX_FREQUENCY = 16.0


def _valid_device(_instance: Any, _attribute: Any, value: Any) -> None:
    try:
        torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"got {value!r}; allowed: a torch device such as 'cpu', 'cuda', 'cuda:1'") from exc


def _even(_instance: Any, _attribute: Any, value: Any) -> None:
    if isinstance(value, int) and value % 2:
        raise ValueError(f"got {value!r}; allowed: an even number")


def time_embedding(sigma: torch.Tensor, size: int) -> torch.Tensor:
    """(B,) noise levels -> (B, size) [cos, sin] features at geometric frequencies 1.._MAX_FREQUENCY."""
    half = size // 2
    freqs = torch.exp(torch.linspace(0.0, math.log(_MAX_FREQUENCY), half, device=sigma.device, dtype=torch.float32))
    args = sigma.to(torch.float32)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1)


class VelocityMLP(nn.Module):
    """v(x, sigma, c) = MLP([x, c, time_embedding(sigma)]) with SiLU between ``layers`` Linears.

    The Linear layers are ``layers.0`` ... ``layers.{n-1}`` (the names LoRA targets).
    """

    def __init__(self, dim: int, cond_dim: int, hidden: int, layers: int, time_dim: int):
        super().__init__()
        self.time_dim = time_dim
        sizes = [dim + cond_dim + time_dim] + [hidden] * (layers - 1) + [dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(sizes))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        weight = self.layers[0].weight
        assert isinstance(weight, torch.Tensor)  # a Linear (or peft's LoRA Linear, whose weight is its base's)
        dtype = weight.dtype
        h = torch.cat([x, cond, time_embedding(sigma, self.time_dim)], dim=1).to(dtype)
        for layer in self.layers[:-1]:
            h = nn.functional.silu(layer(h))
        return self.layers[-1](h)


def base_samples(kind: str, n: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """Samples of the distributions ``pretrain_data`` names (float32, CPU).

    - ``modes``: an equal mixture of 2*dim Gaussians (std 0.15) at +-1 on each axis;
    - ``gaussian``: N(0, I).
    """
    if kind == "gaussian":
        return torch.randn(n, dim, generator=generator)
    axis = torch.randint(0, dim, (n,), generator=generator)
    sign = torch.randint(0, 2, (n,), generator=generator).to(torch.float32) * 2 - 1
    centres = torch.zeros(n, dim)
    centres[torch.arange(n), axis] = sign
    return centres + 0.15 * torch.randn(n, dim, generator=generator)


@attrs.define(eq=False)
class VectorPolicy:
    """A flow-matching MLP policy over R^dim; prompts select a target (see fgrpo.core.vectors).

    The base network is reproducible: its weights are drawn from the seed ``init`` (or read from
    the safetensors file ``path``), then optionally fitted with ``pretrain_steps`` steps of
    rectified-flow matching to ``pretrain_data``, a distribution that ignores the prompt.

    Fine-tuning: ``lora: {rank: r}`` puts peft LoRA adapters on every Linear layer (only they are
    trained; ``reference()`` disables them). ``lora: null`` (the default) trains all weights; the network is
    tiny, so the policy keeps a frozen copy of the base weights, taken at construction, for
    ``reference()``. Both give the same reference: the base model, before any training.
    """

    dim: int = param(2, ge=1, help="dimension of the generated vectors")
    cond_dim: int | None = param(
        None,
        ge=0,
        help="size of the prompt conditioning: the target, then a hashed code of the "
        "text; none = dim; 0 = unconditional",
    )
    hidden: int = param(64, ge=1, le=1 << 16, help="width of the MLP")
    layers: int = param(3, ge=1, help="number of Linear layers")
    time_dim: int = param(16, ge=2, validator=_even, help="size of the sinusoidal embedding of sigma")
    shift: float = param(3.0, gt=0, help="time shift s of the default schedule: s*t/(1+(s-1)*t)")
    lora: dict | None = lora_param(8, None, default=False)
    init: int = param(0, help="seed of the initial weights (and of pretraining and LoRA init)")
    path: str | None = param(None, help="safetensors file with the base weights (VectorPolicy.save_base)")
    pretrain_steps: int = param(
        0, ge=0, help="flow-matching steps fitting the base to pretrain_data at construction (300: ~1 s)"
    )
    pretrain_data: str = param(
        "modes", choices=("modes", "gaussian"), help="base distribution: 2*dim modes at +-1 per axis, or N(0, I)"
    )
    dtype: str = param("float32", choices=tuple(DTYPES), help="dtype of the weights")
    device: str | torch.device = param("cpu", validator=_valid_device, help="torch device of the network")

    evaluations_per_call: int = attrs.field(default=1, init=False)
    _small: SmallNet[VelocityMLP] = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.cond_dim is None:
            self.cond_dim = self.dim
        self.device = torch.device(self.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.init)
            net = VelocityMLP(self.dim, self.cond_dim, self.hidden, self.layers, self.time_dim)
        if self.path is not None:
            net.load_state_dict(_read_base(self.path, net), strict=True)
        if self.pretrain_steps:
            _pretrain(net, self.pretrain_steps, self.pretrain_data, self.dim, self.cond_dim, self.init)
        net.requires_grad_(False)
        net.to(device=self.device, dtype=self.torch_dtype)
        if self.lora is not None and self.lora["target_modules"] is None:  # every Linear layer
            self.lora = {**self.lora, "target_modules": [f"layers.{i}" for i in range(len(net.layers))]}
        # LoRA's default init (B = 0) starts the adapted model exactly at the base
        self._small = SmallNet(net, self.lora, seed=self.init + 2, device=self.device)

    # --- construction helpers -------------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def net(self) -> VelocityMLP:
        """The trained network (with its LoRA layers, if any)."""
        return self._small.trained

    # --- the Policy protocol --------------------------------------------------------------------

    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        """(B, cond_dim) float32: each prompt's target followed by a hashed code of its text."""
        assert self.cond_dim is not None  # resolved by __attrs_post_init__
        if not prompts:
            return torch.zeros(0, self.cond_dim, device=self.device)
        rows = [condition_vector(p, self.dim, self.cond_dim) for p in prompts]
        return torch.stack(rows).to(self.device)

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(n, dim) float32 standard normal noise on ``device``."""
        return seeding.randn((n, self.dim), generator, self.device)

    def sigmas(self, steps: int) -> torch.Tensor:
        """(steps + 1,) float32 from 1 to 0: a linear schedule with the SD3 time shift ``shift``."""
        return flow.shifted_sigmas(steps, self.shift, self.device)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """v = eps - x0 at noise level ``sigma`` ((B,) or a scalar), in the dtype of ``x``."""
        sigma = torch.as_tensor(sigma, device=x.device)
        if sigma.dim() == 0:
            sigma = sigma.expand(x.shape[0])
        net = self._small.module()
        flat = x.reshape(x.shape[0], -1)
        out = net(flat, sigma, cond.reshape(cond.shape[0], -1).to(flat.dtype))
        return out.to(x.dtype).reshape(x.shape)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The identity: the generated vectors are the outputs (float32)."""
        return latents.to(torch.float32)

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        return self._small.parameters()

    def reference(self) -> AbstractContextManager[None]:
        """Within this context ``velocity`` is the base model (LoRA off, or the frozen base copy)."""
        return self._small.reference()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained tensors only (LoRA weights, or every weight at rank 0), detached CPU copies."""
        return self._small.state_dict()

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._small.load_state_dict(state, f"this vector policy (lora {self.lora})")

    # --- extras ---------------------------------------------------------------------------------

    def to(self, device: str | torch.device) -> VectorPolicy:
        """Moves the networks to ``device`` (parameters keep their identity)."""
        self.device = torch.device(device)
        self._small.to(self.device)
        return self

    def base_state_dict(self) -> dict[str, torch.Tensor]:
        """The base weights (no LoRA) under the plain names ``layers.{i}.weight|bias``."""
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in self._small.base().state_dict().items()}

    def save_base(self, path: str | Path) -> None:
        """Writes the base weights as safetensors, for the ``path`` key of a later run."""
        from safetensors.torch import save_file

        save_file(self.base_state_dict(), str(path))


def _read_base(path: str, net: VelocityMLP) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.path: no such file {str(file)!r} (a safetensors file of base weights)")
    state = load_file(str(file))
    expected = net.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if state[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"model.path: {str(file)!r} does not fit dim/cond_dim/hidden/layers/time_dim of this "
            f"policy: missing {missing or 'none'}, unexpected {unexpected or 'none'}, "
            f"wrong shape {wrong or 'none'}"
        )
    return {k: v.to(torch.float32) for k, v in state.items()}


def _pretrain(net: VelocityMLP, steps: int, kind: str, dim: int, cond_dim: int, seed: int) -> None:
    """Rectified-flow matching of ``net`` to ``kind`` (prompt-independent): batch 256, Adam 2e-2
    with cosine decay (about 300 steps fit the 2-D modes), on one CPU thread (tiny matmuls are
    fastest there; the caller's thread setting is restored)."""
    gen = torch.Generator().manual_seed(seed + 1)
    net.requires_grad_(True)
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            x0 = base_samples(kind, 256, dim, gen)
            eps = torch.randn(256, dim, generator=gen)
            sigma = torch.rand(256, generator=gen)
            cond = torch.rand(256, cond_dim, generator=gen) * 2 - 1  # the data ignores the prompt
            xt = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps
            loss = (net(xt, sigma, cond) - (eps - x0)).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
        net.requires_grad_(False)
