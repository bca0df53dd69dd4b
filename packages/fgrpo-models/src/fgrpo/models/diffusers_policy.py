"""``DiffusersPolicy``: a diffusers pipeline as an fgrpo :class:`~fgrpo.core.protocols.Policy`.

The four built-in backbones (``sd3``, ``flux``, ``qwen-image``, ``wan``) are subclasses of this
class, each one module that says what differs: which pipeline, how prompts are encoded, how the
transformer is called, how latents are decoded (docs/backbones.md). Everything else is here:

- loading from a hub id or a local folder (fails fast when weights are absent), weights dtype,
  device, text encoders optionally kept on the CPU;
- the LoRA adapter (peft) with per-backbone default targets, or full fine-tuning; the
  reference policy (adapter disabled); trainable state; export in diffusers' own LoRA format;
- a per-prompt cache of text-encoder outputs, classifier-free guidance with a negative prompt;
- the schedule: the pipeline scheduler's own sigmas (optionally with a fixed time shift);
- gradient checkpointing, VAE decoding in chunks (and tiles).

Conventions every backbone keeps (and its tests check against the pipeline's own output):

- the state ``x`` is the pipeline's latent *before* any token packing, batch first
  (B, C, h, w) for images, (B, C, t, h, w) for videos, float32;
- ``velocity`` returns v = eps - x0 in that layout, float32, guidance applied, whatever the
  weights dtype (the kernels do their arithmetic in float32);
- ``cond`` holds batch-first tensors only. Tensors without a batch dimension (FLUX's image and
  text ids, rotary tables, Qwen-Image's image shapes) are derived inside ``velocity`` from the
  shapes of ``x`` and ``cond``: the trainer may index, repeat and concatenate every ``cond``
  leaf along dimension 0 (see :class:`fgrpo.core.protocols.Policy`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx
from fgrpo.models.lora import (
    adapters_disabled,
    inject_lora,
    load_trainable_state,
    lora_param,
    read_lora_file,
    save_diffusers_lora,
    trainable_state,
)

NEGATIVE = "negative_"


def _resolution(_inst: Any, _attribute: Any, value: Any) -> None:
    def positive(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    if value is None or positive(value):
        return
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(positive, value)):
        return
    raise ValueError(f"got {value!r}; allowed: a positive integer (square), [height, width], or null (the pipeline's default)")


def _optional_device(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        dx.check_device(inst, attribute, value)


@attrs.define(eq=False)
class DiffusersPolicy:
    """Base of the diffusers backbones; a subclass sets the class attributes and implements
    ``cfg_scale``, ``_encode_uncached`` and ``_predict`` (``_decode`` and ``_latent_shape_for``
    default to an image pipeline with an ``AutoencoderKL``).

    Build one from a recipe (``path``) or around an already built pipeline with
    :meth:`from_pipeline`. The policy owns the pipeline: it moves it to ``device``/``dtype``,
    freezes the VAE and text encoders and adds the LoRA adapter to ``pipeline.transformer`` in
    place. With full fine-tuning (``lora: null``) there is no frozen reference and
    ``reference()`` raises: use LoRA, or an objective without a KL term.
    """

    #: the diffusers pipeline class this backbone drives
    pipeline_class_name: ClassVar[str] = ""
    #: the pipeline's text encoder attributes (frozen, optionally kept on the CPU)
    text_encoder_names: ClassVar[tuple[str, ...]] = ("text_encoder",)
    #: the transformer's timestep input is sigma times this (1000 for SD3/Wan, 1 for FLUX/Qwen)
    timestep_scale: ClassVar[float] = 1000.0
    #: the pipeline passes sigmas=linspace(1, 1/steps, steps) to its scheduler (FLUX, Qwen-Image)
    explicit_sigma_grid: ClassVar[bool] = False
    #: the transformer sees 2x2 patches of the latent as tokens (FLUX, Qwen-Image): the state stays
    #: the unpacked latent, ``velocity`` packs and unpacks
    packs_2x2: ClassVar[bool] = False

    path: str = param(help="hub id or local folder (save_pretrained output) of the diffusers pipeline")
    dtype: str = param(
        "float32", choices=dx.DTYPE_CHOICES, help="weights dtype of the whole pipeline (LoRA weights stay float32)"
    )
    device: str | torch.device = param("auto", validator=dx.check_device, help=dx.DEVICE_HELP)
    text_encoder_device: str | None = param(
        None, validator=_optional_device, help="where the text encoders run (e.g. 'cpu' to keep GPU memory free); null: device"
    )
    resolution: int | list[int] | None = param(
        None, validator=_resolution, help="output height = width in pixels, or [height, width]; null: the pipeline's default"
    )
    negative_prompt: str = param("", help="the unconditional prompt of classifier-free guidance")
    lora: dict | None = lora_param(32, ("to_q", "to_k", "to_v", "to_out.0"))
    lora_path: str | None = param(None, help="adapter weights to start from (.safetensors file or folder, fgrpo's or diffusers' format)")
    shift: float | None = param(None, gt=0, help="fixed time shift of sigmas(steps); null: the pipeline scheduler's own (static or by resolution)")
    gradient_checkpointing: bool = param(False, help="recompute transformer blocks in backward to save memory")
    prompt_cache_size: int = param(1024, ge=0, help="prompts whose embeddings are kept on device (LRU); 0: no cache")
    decode_batch_size: int = param(0, ge=0, help="samples per VAE decode call; 0: the whole batch at once")
    vae_tiling: bool = param(False, help="decode in spatial tiles (the VAE's enable_tiling): less memory, large outputs")

    _pipeline: Any = attrs.field(default=None, repr=False, alias="pipeline")
    _cache: dx.PromptCache = attrs.field(init=False, repr=False)
    _torch_dtype: torch.dtype = attrs.field(init=False, repr=False)
    _latent_shape: tuple[int, ...] = attrs.field(init=False, repr=False)
    _size: tuple[int, int] = attrs.field(init=False, repr=False)

    # --- what a backbone module provides --------------------------------------------------------

    @property
    def cfg_scale(self) -> float:
        """The classifier-free guidance scale (> 1: a negative branch, NFE 2 per call)."""
        raise NotImplementedError

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """Batch-first text-encoder outputs of these prompts (computed on ``device``)."""
        raise NotImplementedError

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's float32 output for states ``x`` (B, *latent_shape) at ``sigma`` (B,), in
        the transformer's own layout (packed tokens for FLUX/Qwen-Image)."""
        raise NotImplementedError

    def _transformer_output(
        self, hidden_states: torch.Tensor, sigma: torch.Tensor, as_given: Mapping[str, Any] | None = None, **embeds: torch.Tensor
    ) -> torch.Tensor:
        """The transformer's float32 output: ``hidden_states`` and ``embeds`` cast to its dtype, the
        timestep ``sigma * timestep_scale``, the ``as_given`` inputs (ids, masks, guidance) as they are."""
        transformer = self.transformer
        dtype = transformer.dtype
        return transformer(
            hidden_states=hidden_states.to(dtype),
            timestep=sigma * self.timestep_scale,
            **{name: t.to(dtype) for name, t in embeds.items()},
            **dict(as_given or {}),
            return_dict=False,
        )[0].float()

    def _to_state(self, out: torch.Tensor) -> torch.Tensor:
        """The transformer's layout -> the state layout (identity unless tokens are packed)."""
        if self.packs_2x2:
            return dx.unpack_2x2(out, *self._latent_shape[-2:])
        return out

    def _combine(self, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Guidance in the transformer's layout (Qwen-Image also rescales the norm)."""
        return dx.guided(uncond, cond, self.cfg_scale)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Outputs of one chunk of final latents, float32 in [0, 1]. Default: an ``AutoencoderKL``
        whose latents are ``(z - shift_factor) * scaling_factor`` (SD3, FLUX), as the pipelines do."""
        vae = self._pipeline.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def _latent_shape_for(self, height: int, width: int) -> tuple[int, ...]:
        """An image latent (C, H/s, W/s); C is the transformer's input channels (a quarter of them
        when it sees 2x2 patches)."""
        scale = self.vae_scale_factor
        channels = int(self.transformer.config.in_channels) // (4 if self.packs_2x2 else 1)
        return (channels, height // scale, width // scale)

    def _default_size(self) -> tuple[int, int]:
        pipe = self._pipeline
        side = int(getattr(pipe, "default_sample_size", 0) or self.transformer.config.get("sample_size", 64)) * self.vae_scale_factor
        return side, side

    def _patch(self) -> int:
        return 2 if self.packs_2x2 else int(self.transformer.config.get("patch_size", 1) or 1)

    def _size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE scale x patch size)."""
        return self.vae_scale_factor * self._patch()

    def _image_seq_len(self) -> int:
        """Image tokens of one latent (for the resolution-dependent time shift)."""
        patch = self._patch()
        h, w = self._latent_shape[-2:]
        return (h // patch) * (w // patch)

    def _check_pipeline(self, pipe: Any) -> None:
        """Refuse pipelines this backbone cannot drive (a subclass may add checks)."""

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def pipeline_class(cls) -> Any:
        return getattr(importlib.import_module("diffusers"), cls.pipeline_class_name)

    @classmethod
    def from_pipeline(cls, pipeline: Any, **keys: Any) -> DiffusersPolicy:
        """Wrap an already built pipeline (taken over and modified in place)."""
        path = keys.pop("path", None) or getattr(pipeline, "name_or_path", None) or "<in-memory pipeline>"
        return cls(path=str(path), pipeline=pipeline, **keys)

    def __attrs_post_init__(self) -> None:
        if self.lora is None and self.lora_path is not None:
            raise ValueError("model.lora_path needs a LoRA adapter; set model.lora (rank > 0)")
        self.device = dx.resolve_device(self.device)
        self._torch_dtype = dx.parse_dtype(self.dtype)
        if self._pipeline is None:
            self._pipeline = dx.load_pipeline(self.pipeline_class_name, self.path, self._torch_dtype)
        pipe = self._pipeline
        self._check_pipeline(pipe)
        modules = self.modules()
        if any(m.dtype != self._torch_dtype for m in modules):
            pipe.to(dtype=self._torch_dtype)  # only when needed: diffusers warns on every cast
        pipe.to(self.device)
        for module in self.text_encoders():
            module.to(self.text_device)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        dx.freeze(*modules)
        transformer = self.transformer
        if self.lora is not None:
            inject_lora(transformer, self.lora)
            if self.lora_path is not None:
                self.load_trainable_state_dict(read_lora_file(self.lora_path))
        else:
            transformer.requires_grad_(True)
        if self.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        if self.vae_tiling and hasattr(pipe.vae, "enable_tiling"):
            pipe.vae.enable_tiling()
        self._cache = dx.PromptCache(self.prompt_cache_size)
        if self.resolution is None:
            height, width = self._default_size()
        elif isinstance(self.resolution, int):
            height = width = self.resolution
        else:
            height, width = (int(v) for v in self.resolution)
        multiple = self._size_multiple()
        if height % multiple or width % multiple:
            raise ValueError(
                f"model.resolution: got {height}x{width}; height and width must be multiples of {multiple} "
                "(VAE scale x patch size)"
            )
        self._size = (height, width)
        self.resolution = height if height == width else [height, width]
        self._latent_shape = tuple(self._latent_shape_for(height, width))

    # --- what the policy is made of -------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        return self._pipeline

    @property
    def transformer(self) -> torch.nn.Module:
        return self._pipeline.transformer

    @property
    def trainable_module(self) -> torch.nn.Module:
        """What a sharded (FSDP) run splits over the processes: the transformer, one FSDP unit per
        block (its ``_no_split_modules``)."""
        return self.transformer

    @property
    def text_device(self) -> torch.device:
        return dx.resolve_device(self.text_encoder_device) if self.text_encoder_device is not None else self.device

    def text_encoders(self) -> list[torch.nn.Module]:
        found = (getattr(self._pipeline, n, None) for n in self.text_encoder_names)
        return [m for m in found if isinstance(m, torch.nn.Module)]

    def modules(self) -> list[torch.nn.Module]:
        """The pipeline's networks: transformer, VAE, text encoders."""
        found = [getattr(self._pipeline, n, None) for n in ("transformer", "vae")]
        return [m for m in found if isinstance(m, torch.nn.Module)] + self.text_encoders()

    @property
    def vae_scale_factor(self) -> int:
        pipe = self._pipeline
        return int(getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None) or 8)

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the outputs in pixels."""
        return self._size

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one state (without the batch dimension)."""
        return self._latent_shape

    @property
    def cfg(self) -> bool:
        return self.cfg_scale > 1.0

    @property
    def evaluations_per_call(self) -> int:
        return 2 if self.cfg else 1

    @property
    def prompt_cache(self) -> dx.PromptCache:
        return self._cache

    # --- Policy ---------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """The backbone's text-encoder outputs, batch first, computed once per distinct prompt and
        cached (LRU, ``prompt_cache_size``); with guidance also ``negative_*``: the negative
        prompt's, an expanded view over the batch."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        cond = self._cache.get(prompts, self._encode_on_device)
        if self.cfg:
            negative = self._cache.get([self.negative_prompt], self._encode_on_device)
            for key, value in negative.items():
                cond[NEGATIVE + key] = value.expand(len(prompts), *value.shape[1:])
        return cond

    def _encode_on_device(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        out = self._encode_uncached(prompts, self.text_device)
        return {k: v.to(self.device) for k, v in out.items()}

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Standard normal states (n, *latent_shape), float32 on ``device``, drawn like the
        pipeline's ``prepare_latents`` (on the generator's device, then moved)."""
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor((n, *self._latent_shape), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, steps: int) -> torch.Tensor:
        """(steps + 1,) float32 on ``device`` from 1 to 0: the sigmas ``pipe(num_inference_steps=steps)``
        integrates over at this resolution (or with the fixed ``shift``)."""
        return dx.scheduler_sigmas(
            self._pipeline.scheduler,
            steps,
            shift=self.shift,
            device=self.device,
            image_seq_len=self._image_seq_len(),
            explicit_grid=self.explicit_sigma_grid,
        )

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """v = eps - x0 at noise level ``sigma`` ((B,) or a scalar), float32, guidance applied (one
        forward of the doubled batch [negative; positive])."""
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        sigma = sigma.expand(b) if sigma.ndim == 0 else sigma.reshape(b)
        x = x.to(self.device, torch.float32)
        positive = {k: v for k, v in cond.items() if not k.startswith(NEGATIVE)}
        if not self.cfg:
            return self._to_state(self._predict(x, sigma, positive))
        missing = [k for k in positive if NEGATIVE + k not in cond]
        if missing:
            raise ValueError(f"guidance (scale {self.cfg_scale}) needs negative embeddings in cond ({NEGATIVE}{missing[0]}): build it with encode()")
        both = {k: torch.cat([cond[NEGATIVE + k].to(self.device), v.to(self.device)]) for k, v in positive.items()}
        out = self._predict(torch.cat([x, x]), torch.cat([sigma, sigma]), both)
        uncond, text = out.chunk(2)
        return self._to_state(self._combine(uncond, text))

    def to_pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        """States in the layout the pipeline's ``latents=`` argument takes (packed for FLUX/Qwen)."""
        return dx.pack_2x2(x) if self.packs_2x2 else x

    def from_pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """``pipe(..., output_type="latent")`` output -> states (the inverse of ``to_pipeline_latents``)."""
        return self._to_state(latents)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Outputs as the pipeline makes them with ``output_type="pt"``: images (B, 3, H, W) or
        videos (B, T, 3, H, W), float32 in [0, 1]; ``decode_batch_size`` samples per VAE call."""
        chunk = self.decode_batch_size or latents.shape[0]
        parts = [self._decode(part.to(self.device)) for part in latents.split(chunk)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The LoRA weights (float32), or every transformer weight with full fine-tuning."""
        if self.lora is None:
            return list(self.transformer.parameters())
        return [p for p in self.transformer.parameters() if p.requires_grad]

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen base model: the LoRA adapter disabled inside, re-enabled exactly after."""
        if self.lora is None:
            raise RuntimeError(
                "model.reference(): full fine-tuning (model.lora null or rank 0) keeps no frozen reference; "
                "use a LoRA adapter (model.lora.rank > 0) or an objective without a KL term (beta 0)"
            )
        with adapters_disabled(self.transformer):
            yield

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies: the LoRA weights (peft names) or the transformer's full state dict."""
        return trainable_state(self.transformer, lora=self.lora is not None)

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        load_trainable_state(self.transformer, state, lora=self.lora is not None)

    # --- export ---------------------------------------------------------------------------------

    @property
    def export_in_checkpoints(self) -> bool:
        """Checkpoints also hold :meth:`export`'s files (a LoRA is small; a full transformer is not)."""
        return self.lora is not None

    def export(self, folder: str, state: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """The trained weights in diffusers' own format: the adapter as the pipeline's
        ``save_lora_weights`` writes it (``pipe.load_lora_weights(folder)`` loads it with its
        rank and alpha), or with full fine-tuning the transformer's ``save_pretrained`` in
        ``folder/transformer``. ``state``: a LoRA's :meth:`trainable_state_dict` to write instead
        of the transformer's current adapter (a sharded run gathers it first). Returns the files
        written."""
        import os

        if self.lora is not None:
            return [save_diffusers_lora(type(self._pipeline), self.transformer, folder, state)]
        if state is not None:
            raise ValueError("export(state=...) takes LoRA weights; a fully fine-tuned transformer exports its own")
        target = os.path.join(folder, "transformer")
        self.transformer.save_pretrained(target)
        return sorted(os.path.join(target, f) for f in os.listdir(target))


__all__ = ["DiffusersPolicy", "NEGATIVE"]
