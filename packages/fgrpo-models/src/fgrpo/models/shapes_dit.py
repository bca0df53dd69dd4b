"""``shapes-dit``: a small pixel-space flow model for the shapes world, shipped pretrained.

The network is diffusers' ``SD3Transformer2DModel`` over 24x24 RGB pixels (patch size 8: one
token per cell of the shapes world's 3x3 grid, 9 image tokens) conditioned by a word-level text
encoder of its own: the shapes grammar has a tiny closed vocabulary, so every word is one token
(``nn.Embedding`` + a learned position embedding + ``text_layers`` small pre-norm transformer
layers). The encoder's output sequence is ``encoder_hidden_states`` (width ``text_width`` =
``joint_attention_dim``); the pooled vector (``pooled_projection_dim``) is a projection of the
leading start token's output and of the mean over the prompt's tokens.

Conventions: latents are pixels in [-1, 1], shape (B, 3, 24, 24); the transformer predicts the
clean image x0 (``prediction: x0`` in the architecture: with 8x8x3 = 192 values per token a
velocity output would have to carry each patch's full noise through the network, which left
every pixel visibly noisy) and ``velocity`` returns v = (x - x0_hat) / sigma = eps - x0 in
float32 (x_sigma = (1 - sigma) x0 + sigma eps); ``decode`` maps x/2 + 1/2 clamped to [0, 1];
``sigmas(steps)`` is linear in t with the SD3 time shift ``shift``.

Weights: a safetensors file whose tensors are ``text.*`` (the text encoder) and ``transformer.*``
(the SD3 transformer) and whose metadata holds the architecture and the vocabulary, so a recipe
names no architecture (architecture keys given in a recipe must agree with the file). The
default file ships in the wheel (``fgrpo/models/weights/shapes-base.safetensors``, made by
``tools/pretrain_shapes.py``).

Fine-tuning: the text encoder is always frozen (its output is stored with each rollout, so it
could not be trained by the update anyway). ``lora`` (default null = full fine-tuning of the
transformer, the set-up the feasibility prototypes trained) or a peft LoRA adapter on the
transformer (``rank > 0``). ``reference()`` is the base model: LoRA disabled, or, with full
fine-tuning, a frozen copy of the base transformer kept at construction (``reference_copy``;
the network is small).

diffusers, peft and safetensors are imported lazily: listing plugins never imports them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from fgrpo.core import flow, seeding
from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx

#: The shipped base weights (package data of fgrpo-models).
WEIGHTS_RESOURCE = "weights/shapes-base.safetensors"

PAD, START = "<pad>", "<start>"
SPECIALS = (PAD, START)

#: LoRA on both attention streams of every joint block, as for sd3.
SHAPES_LORA_TARGETS = dx.JOINT_ATTENTION_LORA_TARGETS

PREDICTIONS = ("x0", "velocity")
#: sigma is clamped to this in velocity = (x - x0_hat) / sigma (samplers never evaluate sigma = 0).
SIGMA_FLOOR = 1e-3

#: Recipe keys that describe the architecture (null = the weights file's value).
ARCH_KEYS = ("hidden", "layers", "heads", "text_width", "text_layers", "max_words")


def vocabulary_of(prompts: Iterable[str]) -> tuple[str, ...]:
    """The token list of a closed prompt set: the special tokens, then every word, sorted."""
    words = sorted({w for p in prompts for w in tokenize_words(p)})
    return SPECIALS + tuple(words)


def tokenize_words(prompt: str) -> list[str]:
    """Lower case, final full stop dropped, split on white space ("" -> [])."""
    return str(prompt).lower().strip().rstrip(".").split()


# --- the architecture ---------------------------------------------------------------------------


@attrs.frozen
class Architecture:
    """Everything needed to build the network; stored as JSON in the weights file's metadata."""

    vocab: tuple[str, ...] = attrs.field(converter=tuple)
    hidden: int = 192
    layers: int = 4
    heads: int = 3
    text_width: int = 128
    text_layers: int = 1
    text_heads: int = 2
    max_words: int = 10
    size: int = 24
    patch: int = 8
    channels: int = 3
    qk_norm: str | None = "rms_norm"
    #: what the transformer outputs: "x0" (the clean pixels; velocity = (x - x0_hat) / sigma) or
    #: "velocity" (v directly). x0 lies on a tiny set per cell while v carries the full 192-dim
    #: noise of each 8x8x3 patch through a 192-wide network (as in JiT, "Back to Basics: Let
    #: Denoising Generative Models Denoise"). Measured with this architecture: v-prediction still
    #: had a median pixel error of 17/255 and 0.4% verifier-readable cells after 1200 steps;
    #: x0-prediction had 98% readable cells after 300 steps and 100% from 900 on.
    prediction: str = "x0"

    def __attrs_post_init__(self) -> None:
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"prediction {self.prediction!r}; allowed: {', '.join(PREDICTIONS)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} must be a multiple of heads {self.heads}")
        if self.text_width % self.text_heads:
            raise ValueError(f"text_width {self.text_width} must be a multiple of text_heads {self.text_heads}")
        if self.size % self.patch:
            raise ValueError(f"size {self.size} must be a multiple of patch {self.patch}")
        if tuple(self.vocab[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"the vocabulary must start with {SPECIALS}")

    @property
    def tokens(self) -> int:
        """Text sequence length: the start token and ``max_words`` words."""
        return self.max_words + 1

    def to_json(self) -> str:
        return json.dumps({**attrs.asdict(self), "vocab": list(self.vocab)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Architecture:
        return cls(**json.loads(text))


class TextBlock(nn.Module):
    """Pre-norm self-attention + GELU MLP over the word tokens (padding masked as keys)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).reshape(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]  # (B, 1, 1, N) True = attend
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(a.transpose(1, 2).reshape(b, n, w))
        return h + self.mlp(self.norm2(h))


class TextEncoder(nn.Module):
    """Word ids (B, tokens) -> (encoder_hidden_states (B, tokens, width), pooled (B, width))."""

    def __init__(self, arch: Architecture):
        super().__init__()
        w = arch.text_width
        self.embed = nn.Embedding(len(arch.vocab), w)
        self.position = nn.Parameter(torch.zeros(1, arch.tokens, w))
        self.blocks = nn.ModuleList(TextBlock(w, arch.text_heads) for _ in range(arch.text_layers))
        self.norm = nn.LayerNorm(w)
        self.pool = nn.Linear(2 * w, w)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = ids != 0  # the start token is never padding: no row is fully masked
        h = self.embed(ids) + self.position[:, : ids.shape[1]]
        for block in self.blocks:
            h = block(h, keep)
        h = self.norm(h)
        k = keep.to(h.dtype)[..., None]
        mean = (h * k).sum(1) / k.sum(1)
        pooled = self.pool(torch.cat([h[:, 0], mean], dim=-1))
        return h, pooled


class ShapesNetwork(nn.Module):
    """The whole model: ``text`` (:class:`TextEncoder`) + ``transformer`` (SD3Transformer2DModel)."""

    def __init__(self, arch: Architecture):
        super().__init__()
        from diffusers import SD3Transformer2DModel

        self.arch = arch
        self.word_ids = {w: i for i, w in enumerate(arch.vocab)}
        self.text = TextEncoder(arch)
        self.transformer = SD3Transformer2DModel(
            sample_size=arch.size,
            patch_size=arch.patch,
            in_channels=arch.channels,
            out_channels=arch.channels,
            num_layers=arch.layers,
            attention_head_dim=arch.hidden // arch.heads,
            num_attention_heads=arch.heads,
            joint_attention_dim=arch.text_width,
            caption_projection_dim=arch.hidden,
            pooled_projection_dim=arch.text_width,
            pos_embed_max_size=arch.size // arch.patch,
            qk_norm=arch.qk_norm,
        )

    def token_ids(self, prompts: Sequence[str], device: torch.device | str = "cpu") -> torch.Tensor:
        """(B, tokens) long: the start token, the words, then padding. Unknown words and prompts
        longer than ``max_words`` raise ``ValueError``."""
        start = self.word_ids[START]
        rows = []
        for prompt in prompts:
            words = tokenize_words(prompt)
            unknown = [w for w in words if w not in self.word_ids or w in SPECIALS]
            if unknown:
                known = ", ".join(self.arch.vocab[len(SPECIALS):])
                raise ValueError(f"prompt {prompt!r}: word(s) {unknown} not in the shapes-dit vocabulary ({known})")
            if len(words) > self.arch.max_words:
                raise ValueError(f"prompt {prompt!r} has {len(words)} words; this model reads at most {self.arch.max_words}")
            ids = [start] + [self.word_ids[w] for w in words]
            rows.append(ids + [0] * (self.arch.tokens - len(ids)))
        return torch.tensor(rows, dtype=torch.long, device=device)

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        device = self.text.embed.weight.device
        embeds, pooled = self.text(self.token_ids(prompts, device))
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The transformer's raw output for pixels ``x`` (B, 3, 24, 24) at noise level ``sigma``
        (B,): the clean image x0 (``arch.prediction == "x0"``) or the velocity."""
        return self.transformer(
            hidden_states=x,
            timestep=sigma * 1000.0,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]


def to_velocity(output: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, prediction: str) -> torch.Tensor:
    """The float32 velocity eps - x0 from the transformer's ``output`` at state ``x``, level ``sigma`` (B,)."""
    output = output.float()
    if prediction == "velocity":
        return output
    s = sigma.float().clamp_min(SIGMA_FLOOR).reshape(-1, *([1] * (x.ndim - 1)))
    return (x.float() - output) / s


def flow_loss(
    output: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor, prediction: str, floor: float = 0.05
) -> torch.Tensor:
    """The pretraining loss: velocity MSE against eps - x0 for the transformer's ``output`` at
    x_sigma = (1 - sigma) x0 + sigma eps. With x0-prediction (JiT's "v-loss") the velocity implied
    by the prediction, sigma floored at ``floor``, i.e. ||x0_hat - x0||^2 / max(sigma, floor)^2:
    low noise levels weigh more, which is where the exact palette colours and glyph edges are set."""
    if prediction == "velocity":
        return (output - (eps - x0)).pow(2).mean()
    s = sigma.clamp_min(floor).reshape(-1, *([1] * (x0.ndim - 1)))
    return ((output - x0) / s).pow(2).mean()


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# --- weights files ------------------------------------------------------------------------------


def default_weights_path() -> str:
    """The shipped base weights, as a file path (package data of fgrpo-models)."""
    from importlib.resources import files

    return str(files("fgrpo.models").joinpath(WEIGHTS_RESOURCE))


def save_network(
    network: ShapesNetwork, path: str | Path, dtype: torch.dtype = torch.float16, extra: Mapping[str, str] | None = None
) -> None:
    """Write ``network`` as safetensors (floating tensors cast to ``dtype``) with its architecture
    (and ``extra`` strings, e.g. how it was trained) in the metadata."""
    from safetensors.torch import save_file

    state = {
        k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
        for k, v in network.state_dict().items()
    }
    metadata = {"format": "pt", "fgrpo_model": "shapes-dit", "architecture": network.arch.to_json(), **(extra or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=metadata)


def read_metadata(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_network(path: str | Path) -> ShapesNetwork:
    """Build the network the file describes and load its weights (as float32)."""
    from safetensors.torch import load_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.path: no such file {str(file)!r} (a shapes-dit safetensors file)")
    meta = read_metadata(file)
    if "architecture" not in meta:
        raise ValueError(f"model.path: {str(file)!r} has no 'architecture' metadata: not a shapes-dit weights file")
    network = ShapesNetwork(Architecture.from_json(meta["architecture"]))
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(file)).items()}
    expected = network.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"model.path: {str(file)!r} does not fit its own architecture: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    network.load_state_dict(state, strict=True)
    return network


# --- the policy ---------------------------------------------------------------------------------


def _optional_positive_int(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"got {value!r}; allowed: a positive integer, or null for the weights file's value")


def _optional_count(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"got {value!r}; allowed: an integer >= 0, or null for the weights file's value")


def _arch_key(help_text: str, validator: Any = _optional_positive_int) -> Any:
    return param(None, validator=validator, help=help_text + " (null: the weights file's; must agree with it)")


@attrs.define(eq=False)
class ShapesDiT:
    """The pretrained shapes-world base model; satisfies :class:`fgrpo.core.protocols.Policy`.

    Build it from a recipe (``path``, default: the shipped weights), around a network with
    :meth:`from_network` (tests, ``tools/pretrain_shapes.py``), or randomly initialised with
    ``random_init: true`` (architecture keys then default to :class:`Architecture`'s).
    """

    path: str | None = param(None, help="shapes-dit safetensors weights; null: the shipped base (weights/shapes-base.safetensors)")
    hidden: int | None = _arch_key("transformer width")
    layers: int | None = _arch_key("transformer blocks")
    heads: int | None = _arch_key("attention heads")
    text_width: int | None = _arch_key("text encoder width (= joint_attention_dim)")
    text_layers: int | None = _arch_key("text encoder transformer layers", _optional_count)
    max_words: int | None = _arch_key("longest prompt in words")
    random_init: bool = param(False, help="ignore path: a randomly initialised network of this architecture (tests)")
    lora: dict | None = dx.lora_param(16, SHAPES_LORA_TARGETS, default=False)
    reference_copy: bool = param(
        True, help="with full fine-tuning keep a frozen copy of the base transformer for reference() (KL)"
    )
    guidance_scale: float = param(1.0, ge=1.0, help="classifier-free guidance with the empty prompt; 1 = off, > 1: NFE 2 per call")
    shift: float = param(1.0, gt=0, help="time shift s of sigmas(steps): s*t/(1+(s-1)*t)")
    dtype: str = param("float32", choices=dx.DTYPE_CHOICES, help="weights dtype (LoRA weights stay float32)")
    device: str | torch.device = param("auto", validator=dx.check_device, help=dx.DEVICE_HELP)

    _network: ShapesNetwork | None = attrs.field(default=None, repr=False, alias="network")
    _reference: nn.Module | None = attrs.field(init=False, default=None, repr=False)
    _reference_depth: int = attrs.field(init=False, default=0, repr=False)
    _cache: dx.PromptCache = attrs.field(init=False, repr=False)

    @classmethod
    def from_network(cls, network: ShapesNetwork, **keys: Any) -> ShapesDiT:
        """Wrap an existing :class:`ShapesNetwork` (taken over: moved, frozen, adapted in place)."""
        keys.setdefault("path", "<in-memory network>")
        return cls(network=network, **keys)

    def __attrs_post_init__(self) -> None:
        self.device = dx.resolve_device(self.device)
        torch_dtype = dx.parse_dtype(self.dtype)
        if self._network is None:
            if self.random_init:
                given = {k: getattr(self, k) for k in ARCH_KEYS if getattr(self, k) is not None}
                if "heads" not in given and "hidden" in given:
                    given["heads"] = max(1, given["hidden"] // 64)
                if "text_width" in given:
                    given["text_heads"] = max(1, given["text_width"] // 64)
                self._network = ShapesNetwork(Architecture(vocab=default_vocabulary(), **given))
            else:
                if self.path is None:
                    self.path = default_weights_path()
                self._network = load_network(self.path)
        self._check_architecture()
        net = self._network
        net.to(device=self.device, dtype=torch_dtype)
        dx.freeze(net)
        transformer = net.transformer
        if self.lora is not None:
            dx.inject_lora(transformer, self.lora)
        else:
            if self.reference_copy:
                self._reference = copy.deepcopy(transformer)
                dx.freeze(self._reference)
            transformer.requires_grad_(True)
        self._cache = dx.PromptCache(1024)

    def _check_architecture(self) -> None:
        arch = self._network.arch
        wrong = [
            f"model.{k}: got {getattr(self, k)} but the weights have {getattr(arch, k)}; leave it out (null) to use the file's"
            for k in ARCH_KEYS
            if getattr(self, k) is not None and getattr(self, k) != getattr(arch, k)
        ]
        if wrong:
            raise ValueError("; ".join(wrong))
        for k in ARCH_KEYS:
            setattr(self, k, getattr(arch, k))

    # --- what the policy is made of -------------------------------------------------------------

    @property
    def network(self) -> ShapesNetwork:
        return self._network

    @property
    def transformer(self) -> nn.Module:
        return self._network.transformer

    @property
    def trainable_module(self) -> nn.Module:
        """What a sharded (FSDP) run splits over the processes: the transformer (one FSDP unit per
        joint block); the text encoder and the reference copy stay whole on every process."""
        return self._network.transformer

    @property
    def architecture(self) -> Architecture:
        return self._network.arch

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def evaluations_per_call(self) -> int:
        return 2 if self.cfg else 1

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        a = self.architecture
        return (a.channels, a.size, a.size)

    # --- Policy ---------------------------------------------------------------------------------

    def check_prompts(self, prompts: Sequence[str]) -> list[str]:
        """Why each prompt this model cannot read fails (a word outside its vocabulary, too many
        words); the trainer asks before the first rollout."""
        problems = []
        for prompt in dict.fromkeys(prompts):
            try:
                self._network.token_ids([prompt])
            except ValueError as exc:
                problems.append(str(exc))
        return problems

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """{prompt_embeds (B, tokens, text_width), pooled_prompt_embeds (B, text_width)}, plus
        ``negative_*`` (the empty prompt, an expanded view) with guidance. Frozen and cached."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        cond = self._cache.get(prompts, self._network.encode)
        if self.cfg:
            neg = self._cache.get([""], self._network.encode)
            n = len(prompts)
            for key in ("prompt_embeds", "pooled_prompt_embeds"):
                cond[f"negative_{key}"] = neg[key].expand(n, *neg[key].shape[1:])
        return cond

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(n, 3, 24, 24) float32 standard normal pixels on ``device`` (drawn on the generator's device)."""
        return seeding.randn((n, *self.latent_shape), generator, self.device)

    def sigmas(self, steps: int) -> torch.Tensor:
        """(steps + 1,) float32 from 1 to 0: t linear, then the time shift s*t/(1+(s-1)*t)."""
        return flow.shifted_sigmas(steps, self.shift, self.device)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """v = eps - x0 at noise level ``sigma`` ((B,) or a scalar), float32, guidance applied."""
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        sigma = sigma.expand(b) if sigma.ndim == 0 else sigma.reshape(b)
        transformer = self._reference if (self._reference_depth and self._reference is not None) else self.transformer
        dtype = self._network.text.embed.weight.dtype
        x = x.to(self.device, torch.float32)
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.cfg:
            if "negative_prompt_embeds" not in cond:
                raise ValueError("guidance_scale > 1 needs negative embeddings in cond: build it with encode()")
            x = torch.cat([x, x])
            sigma = torch.cat([sigma, sigma])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        out = transformer(
            hidden_states=x.to(dtype),
            timestep=sigma * 1000.0,
            encoder_hidden_states=embeds.to(self.device, dtype),
            pooled_projections=pooled.to(self.device, dtype),
            return_dict=False,
        )[0]
        out = to_velocity(out, x, sigma, self.architecture.prediction)
        if self.cfg:
            uncond, text = out.chunk(2)
            out = uncond + self.guidance_scale * (text - uncond)
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, 24, 24) float32 in [0, 1]: pixels x/2 + 1/2, clamped."""
        return (latents.float() / 2 + 0.5).clamp(0, 1)

    def trainable_parameters(self) -> Iterable[nn.Parameter]:
        """The LoRA weights (float32), or every transformer weight with full fine-tuning."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen base model: LoRA disabled, or the frozen copy with full fine-tuning."""
        if self.lora is not None:
            with dx.adapters_disabled(self.transformer):
                yield
            return
        if self._reference is None:
            raise RuntimeError(
                "model.reference(): full fine-tuning (model.lora null or rank 0) with model.reference_copy false "
                "keeps no frozen reference; set reference_copy true, use a LoRA adapter (model.lora.rank > 0) "
                "or an objective without a KL term (beta 0)"
            )
        self._reference_depth += 1
        try:
            yield
        finally:
            self._reference_depth -= 1

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies: the LoRA weights (peft names) or the transformer's full state dict."""
        return dx.trainable_state(self.transformer, lora=self.lora is not None)

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        dx.load_trainable_state(self.transformer, state, lora=self.lora is not None)


def default_vocabulary() -> tuple[str, ...]:
    """The shapes grammar's words (for ``random_init``): numbers, colours, shapes and their
    plurals, "and" and the relation words. The pretraining tool builds the same list from the
    grammar itself (:func:`vocabulary_of` over every prompt)."""
    words = ["a", "two", "three", "four", "and", "to", "the", "left", "right", "of", "above", "below"]
    words += ["red", "green", "blue", "yellow"]
    for shape in ("square", "circle", "triangle"):
        words += [shape, shape + "s"]
    return SPECIALS + tuple(sorted(words))


__all__ = [
    "ARCH_KEYS",
    "Architecture",
    "SHAPES_LORA_TARGETS",
    "ShapesDiT",
    "ShapesNetwork",
    "TextEncoder",
    "count_parameters",
    "default_vocabulary",
    "default_weights_path",
    "load_network",
    "read_metadata",
    "save_network",
    "vocabulary_of",
]
