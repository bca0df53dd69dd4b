"""``shapes-dit``: the policy over the shapes world's small pixel-space flow model, shipped
pretrained (the network, its conventions and its weights files: :mod:`fgrpo.worlds.shapes.network`).

Build it from a recipe (``path``, default: the shipped weights); the weights file's metadata holds
the architecture and the vocabulary, so a recipe names no architecture (architecture keys given
in a recipe must agree with the file). ``velocity`` returns v = eps - x0 in float32; ``decode``
maps x/2 + 1/2 clamped to [0, 1]; ``sigmas(steps)`` is linear in t with the SD3 time shift
``shift``.

Fine-tuning: the text encoder is always frozen (its output is stored with each rollout, so it
could not be trained by the update anyway). ``lora`` (default null = full fine-tuning of the
transformer, the set-up the feasibility prototypes trained) or a peft LoRA adapter on the
transformer (``rank > 0``). ``reference()`` is the base model: LoRA disabled, or, with full
fine-tuning, a frozen copy of the base transformer kept at construction (``reference_copy``;
the network is small).

Export (``fgrpo export``, and every LoRA checkpoint's ``export/``): a LoRA as a PEFT adapter
folder, ``PeftModel.from_pretrained(load_network(base).transformer, folder)``; a fully fine-tuned
transformer as a whole shapes-dit weights file that a recipe's ``path`` loads. No diffusers LoRA
file: the transformer is an ``SD3Transformer2DModel`` but no diffusers pipeline can carry it (its
own text encoder and patch embedding), so ``pipe.load_lora_weights`` has nothing to load it into.

diffusers, peft and safetensors are imported lazily: listing plugins never imports them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch
from torch import nn

from fgrpo.core import flow, seeding
from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx
from fgrpo.models.lora import (
    JOINT_ATTENTION_LORA_TARGETS,
    adapters_disabled,
    inject_lora,
    load_trainable_state,
    lora_param,
    save_peft_adapter,
    trainable_state,
)
from fgrpo.worlds.shapes.network import (
    WEIGHTS_RESOURCE,
    Architecture,
    ShapesNetwork,
    default_vocabulary,
    default_weights_path,
    load_network,
    save_network,
    to_velocity,
    transformer_output,
)

if TYPE_CHECKING:  # from its own module: mypy reads diffusers' top-level names as its dummy objects
    from diffusers.models.modeling_utils import ModelMixin

#: LoRA on both attention streams of every joint block, as for sd3.
SHAPES_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS

#: The export of a fully fine-tuned network (a LoRA exports as a PEFT adapter folder).
EXPORT_FILE = "shapes-dit.safetensors"

#: Recipe keys that describe the architecture (null = the weights file's value).
ARCH_KEYS = ("hidden", "layers", "heads", "text_width", "text_layers", "max_words")


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
    :meth:`from_network` (tests, ``fgrpo.worlds.shapes.pretrain``), or randomly initialised with
    ``random_init: true`` (architecture keys then default to :class:`Architecture`'s).
    """

    path: str | None = param(
        None, help="shapes-dit safetensors weights; null: the shipped base (weights/shapes-base.safetensors)"
    )
    hidden: int | None = _arch_key("transformer width")
    layers: int | None = _arch_key("transformer blocks")
    heads: int | None = _arch_key("attention heads")
    text_width: int | None = _arch_key("text encoder width (= joint_attention_dim)")
    text_layers: int | None = _arch_key("text encoder transformer layers", _optional_count)
    max_words: int | None = _arch_key("longest prompt in words")
    random_init: bool = param(False, help="ignore path: a randomly initialised network of this architecture (tests)")
    lora: dict | None = lora_param(16, SHAPES_LORA_TARGETS, default=False)
    reference_copy: bool = param(
        True, help="with full fine-tuning keep a frozen copy of the base transformer for reference() (KL)"
    )
    guidance_scale: float = param(
        1.0, ge=1.0, help="classifier-free guidance with the empty prompt; 1 = off, > 1: NFE 2 per call"
    )
    shift: float = param(1.0, gt=0, help="time shift s of sigmas(steps): s*t/(1+(s-1)*t)")
    dtype: str = param("float32", choices=dx.DTYPE_CHOICES, help="weights dtype (LoRA weights stay float32)")
    device: str | torch.device = param("auto", validator=dx.check_device, help=dx.DEVICE_HELP)

    _network: ShapesNetwork | None = attrs.field(default=None, repr=False, alias="network")
    _reference: nn.Module | None = attrs.field(init=False, default=None, repr=False)
    _reference_depth: int = attrs.field(init=False, default=0, repr=False)
    _cache: dx.PromptCache = attrs.field(init=False, repr=False)

    #: the shipped weights a recipe gets without ``path`` (package data of fgrpo-worlds)
    weights_resource: ClassVar[str] = WEIGHTS_RESOURCE

    def _random_architecture(self, given: dict[str, Any]) -> Architecture:
        """``random_init``'s architecture: the recipe's keys over :class:`Architecture`'s defaults."""
        return Architecture(vocab=default_vocabulary(), **given)

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
                self._network = ShapesNetwork(self._random_architecture(given))
            else:
                if self.path is None:
                    self.path = default_weights_path(self.weights_resource)
                self._network = load_network(self.path)
        self._check_architecture()
        net = self._network
        net.to(device=self.device, dtype=torch_dtype)
        dx.freeze(net)
        transformer = net.transformer
        if self.lora is not None:
            inject_lora(transformer, self.lora)
        else:
            if self.reference_copy:
                self._reference = copy.deepcopy(transformer)
                dx.freeze(self._reference)
            transformer.requires_grad_(True)
        self._cache = dx.PromptCache(1024)

    def _check_architecture(self) -> None:
        arch = self.network.arch
        wrong = [
            f"model.{k}: got {getattr(self, k)} but the weights have {getattr(arch, k)}; leave it out (null) to use "
            f"the file's"
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
        assert self._network is not None, "set by __attrs_post_init__"
        return self._network

    @property
    def transformer(self) -> ModelMixin:
        return self.network.transformer

    @property
    def trainable_module(self) -> nn.Module:
        """What a sharded (FSDP) run splits over the processes: the transformer (one FSDP unit per
        joint block); the text encoder and the reference copy stay whole on every process."""
        return self.network.transformer

    @property
    def architecture(self) -> Architecture:
        return self.network.arch

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
                self.network.token_ids([prompt])
            except ValueError as exc:
                problems.append(str(exc))
        return problems

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """{prompt_embeds (B, tokens, text_width), pooled_prompt_embeds (B, text_width)}, plus
        ``negative_*`` (the empty prompt, an expanded view) with guidance. Frozen and cached."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        cond = self._cache.get(prompts, self.network.encode)
        if self.cfg:
            neg = self._cache.get([""], self.network.encode)
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
        dtype = self.network.text.embed.weight.dtype
        x = x.to(self.device, torch.float32)
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.cfg:
            if "negative_prompt_embeds" not in cond:
                raise ValueError("guidance_scale > 1 needs negative embeddings in cond: build it with encode()")
            x = torch.cat([x, x])
            sigma = torch.cat([sigma, sigma])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        source = cond.get("source")
        if source is not None:
            source = torch.cat([source, source]) if self.cfg else source  # both guidance branches see it
            source = source.to(self.device, dtype)
        out = transformer_output(
            transformer,
            self.architecture,
            x.to(dtype),
            sigma,
            embeds.to(self.device, dtype),
            pooled.to(self.device, dtype),
            source,
        )
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
            with adapters_disabled(self.transformer):
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
        return trainable_state(self.transformer, lora=self.lora is not None)

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        load_trainable_state(self.transformer, state, lora=self.lora is not None)

    # --- export ---------------------------------------------------------------------------------

    @property
    def export_in_checkpoints(self) -> bool:
        """Checkpoints also hold :meth:`export`'s files (an adapter is small; a whole network is not)."""
        return self.lora is not None

    def export(self, folder: str, state: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """The trained weights: a LoRA as peft's ``save_pretrained`` writes it (``adapter_config.json``
        and ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base_transformer, folder)``),
        or with full fine-tuning the whole network as ``shapes-dit.safetensors`` (float32, a recipe's
        ``model.path``). ``state``: a :meth:`trainable_state_dict` to write instead of the
        transformer's current weights. Returns the files written."""
        if self.lora is not None:
            return save_peft_adapter(self.transformer, folder, state)
        path = Path(folder) / EXPORT_FILE
        save_network(
            self.network, path, dtype=torch.float32, extra={"exported_from": "fgrpo"}, transformer_state=state
        )
        return [str(path)]


__all__ = [
    "ARCH_KEYS",
    "EXPORT_FILE",
    "SHAPES_LORA_TARGETS",
    "ShapesDiT",
]
