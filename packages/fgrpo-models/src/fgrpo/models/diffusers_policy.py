"""``DiffusersPolicy``: a diffusers pipeline as an fgrpo :class:`~fgrpo.core.protocols.Policy`.

Every built-in backbone (the ``fgrpo.models`` entry points of fgrpo-models: ``sd3``, ``flux``,
``wan``, ...) is a subclass of this class, each one module that says what differs: which pipeline,
how prompts are encoded, how the transformer is called, how latents are decoded, its token
geometry and published sizes (docs/backbones.md). Everything else is here:

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
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from fgrpo.core import media
from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx
from fgrpo.models import context_parallel, sharded_load
from fgrpo.models.load_plan import Placement, plan
from fgrpo.models.lora import (
    adapters_disabled,
    inject_lora,
    load_trainable_state,
    lora_file_name,
    lora_param,
    read_lora_file,
    save_diffusers_lora,
    save_peft_adapter,
    trainable_state,
)
from fgrpo.models.sizes import Geometry, Published, guidance_forwards

if TYPE_CHECKING:  # from its own module: mypy reads diffusers' top-level names as its dummy objects
    from diffusers.models.modeling_utils import ModelMixin

NEGATIVE = "negative_"


def _resolution(_inst: Any, _attribute: Any, value: Any) -> None:
    def positive(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    if value is None or positive(value):
        return
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(positive, value)):
        return
    raise ValueError(
        f"got {value!r}; allowed: a positive integer (square), [height, width], or null (the pipeline's default)"
    )


def _optional_device(inst: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        dx.check_device(inst, attribute, value)


def _is_euler(scheduler: Any) -> bool:
    from diffusers import FlowMatchEulerDiscreteScheduler

    return isinstance(scheduler, FlowMatchEulerDiscreteScheduler)


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
    #: (least, most) source images per prompt (:mod:`fgrpo.core.media`): (0, 0) text-to-image;
    #: editing backbones take them from ``prompt.images``
    source_image_count: ClassVar[tuple[int, int]] = (0, 0)
    #: ``cond`` keys of non-text conditions (a source image's latents) that both branches of
    #: classifier-free guidance share: ``_conditions`` makes them, no negative is encoded
    shared_condition_keys: ClassVar[tuple[str, ...]] = ()
    #: the text encoder reads the source images too (Qwen-Image-Edit's VL encoder): text
    #: embeddings are then cached per prompt (text and images), else per text
    text_sees_images: ClassVar[bool] = False
    #: how a sample becomes tokens, and the published checkpoints' sizes (fgrpo.models.sizes:
    #: read by the memory estimate and the GPU scripts)
    geometry: ClassVar[Geometry] = Geometry()
    published: ClassVar[Mapping[str, Published]] = {}

    @classmethod
    def forwards_per_sample(cls, keys: Mapping[str, Any]) -> int:
        """Network evaluations per sample and step with the recipe's model ``keys`` (true
        classifier-free guidance doubles them)."""
        return guidance_forwards(keys.get("true_cfg_scale", keys.get("guidance_scale")))

    path: str = param(help="hub id or local folder (save_pretrained output) of the diffusers pipeline")
    dtype: str = param(
        "float32",
        choices=dx.DTYPE_CHOICES,
        help="weights dtype of the transformer, and of the VAE and text encoders unless vae_dtype/text_encoder_dtype "
        "say (LoRA weights stay float32)",
    )
    vae_dtype: str | None = param(
        None, choices=dx.DTYPE_CHOICES, help="weights dtype of the VAE (decoding runs without autocast); null: dtype"
    )
    text_encoder_dtype: str | None = param(
        None,
        choices=dx.DTYPE_CHOICES,
        help="weights dtype of the text encoders (they run without autocast); null: dtype",
    )
    device: str | torch.device = param("auto", validator=dx.check_device, help=dx.DEVICE_HELP)
    text_encoder_device: str | None = param(
        None,
        validator=_optional_device,
        help="where the text encoders run (e.g. 'cpu' to keep GPU memory free); null: device",
    )
    resolution: int | list[int] | None = param(
        None,
        validator=_resolution,
        help="output height = width in pixels, or [height, width]; null: the pipeline's default",
    )
    negative_prompt: str = param("", help="the unconditional prompt of classifier-free guidance")
    lora: dict | None = lora_param(32, ("to_q", "to_k", "to_v", "to_out.0"))
    lora_path: str | None = param(
        None, help="adapter weights to start from (.safetensors file or folder, fgrpo's or diffusers' format)"
    )
    shift: float | None = param(
        None,
        gt=0,
        help="fixed time shift of sigmas(steps); null: the pipeline scheduler's own (static or by resolution)",
    )
    sigma_grid: str = param(
        "diffusers",
        choices=dx.SIGMA_GRIDS,
        help="a multistep flow scheduler's sigmas (Wan 2.1's UniPC): as the installed diffusers spaces them, or as "
        "diffusers 0.33.1 did (flow_grpo's pin; 0.0025 apart at 20 steps, shift 3); Euler schedulers: the same either "
        "way",
    )
    integer_timesteps: bool | None = param(
        None,
        help="the transformer sees int(sigma * 1000) (scaled as its timestep) instead of sigma * 1000: what a "
        "truncating "
        "scheduler (Wan 2.1's UniPC) and DanceGRPO/MixGRPO's FLUX do; null: as the pipeline's scheduler does",
    )
    gradient_checkpointing: bool = param(False, help="recompute transformer blocks in backward to save memory")
    prompt_cache_size: int = param(1024, ge=0, help="prompts whose embeddings are kept on device (LRU); 0: no cache")
    decode_batch_size: int = param(0, ge=0, help="samples per VAE decode call; 0: the whole batch at once")
    vae_tiling: bool = param(
        False, help="decode in spatial tiles (the VAE's enable_tiling): less memory, large outputs"
    )
    context_parallel: dict | None = param(None, converter=context_parallel.convert, help=context_parallel.HELP)

    _pipeline: Any = attrs.field(default=None, repr=False, alias="pipeline")
    _cache: dx.PromptCache = attrs.field(init=False, repr=False)
    _torch_dtype: torch.dtype = attrs.field(init=False, repr=False)
    _integer_timesteps: bool = attrs.field(init=False, repr=False)
    #: sigma (float32) -> the scheduler's integer timestep, from every grid sigmas() made
    _timestep_table: dict = attrs.field(init=False, factory=dict, repr=False)
    _timestep_tensors: tuple | None = attrs.field(init=False, default=None, repr=False)
    #: weights still to read after the launch shards them (:mod:`fgrpo.models.sharded_load`)
    _stand_ins: list[sharded_load.StandIn] = attrs.field(init=False, factory=list, repr=False)
    _latent_shape: tuple[int, ...] = attrs.field(init=False, repr=False)
    _size: tuple[int, int] = attrs.field(init=False, repr=False)
    context_parallel_size: int = attrs.field(init=False, default=1, repr=False)  # 1: each sample whole

    # --- what a backbone module provides --------------------------------------------------------

    @property
    def cfg_scale(self) -> float:
        """The classifier-free guidance scale (> 1: a negative branch, NFE 2 per call)."""
        raise NotImplementedError

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """Batch-first text-encoder outputs of these prompts (computed on ``device``)."""
        raise NotImplementedError

    def _conditions(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first non-text conditions of these prompts (the ``shared_condition_keys``: an
        editing backbone encodes each prompt's source images); none by default."""
        return {}

    def _negative_prompts(self, prompts: list[str]) -> list[str]:
        """The negative prompt of each prompt: one shared row by default (the text alone);
        Qwen-Image-Edit encodes it with each prompt's source images."""
        return [self.negative_prompt]

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The transformer's float32 output for states ``x`` (B, *latent_shape) at ``sigma`` (B,), in
        the transformer's own layout (packed tokens for FLUX/Qwen-Image)."""
        raise NotImplementedError

    def _transformer_output(
        self,
        hidden_states: torch.Tensor,
        sigma: torch.Tensor,
        as_given: Mapping[str, Any] | None = None,
        **embeds: torch.Tensor,
    ) -> torch.Tensor:
        """The transformer's float32 output: ``hidden_states`` and ``embeds`` cast to its dtype, the
        timestep of ``sigma`` (:meth:`_timestep`), the ``as_given`` inputs (ids, masks, guidance) as they are."""
        dtype = self.transformer.dtype
        return self._forward(
            hidden_states=hidden_states.to(dtype),
            timestep=self._timestep(sigma),
            **{name: t.to(dtype) for name, t in embeds.items()},
            **dict(as_given or {}),
            return_dict=False,
        )[0].float()

    def _forward(self, **inputs: Any) -> Any:
        """One call of the network (Wan 2.2 routes it to the expert of the noise level)."""
        return self.transformer(**inputs)

    def _timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep input at ``sigma``: sigma * timestep_scale, or with integer
        timesteps the scheduler's truncated int(sigma * 1000) on the same scale."""
        if not self._integer_timesteps:
            return sigma * self.timestep_scale
        if self._timestep_tensors is None:
            table = sorted(self._timestep_table.items())
            self._timestep_tensors = (
                torch.tensor([k for k, _ in table], dtype=torch.float32),
                torch.tensor([v for _, v in table], dtype=torch.int64),
            )
        return dx.integer_timesteps(sigma, *self._timestep_tensors) * self.timestep_scale / 1000.0

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
        side = (
            int(getattr(pipe, "default_sample_size", 0) or self.transformer.config.get("sample_size", 64))
            * self.vae_scale_factor
        )
        return side, side

    def _patch(self) -> int:
        return 2 if self.packs_2x2 else int(self.transformer.config.get("patch_size", 1) or 1)

    def _size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE scale x patch size)."""
        return self.vae_scale_factor * self._patch()

    def _image_seq_len(self) -> int:
        """Image tokens of one latent (for the resolution-dependent time shift)."""
        h, w = self._latent_shape[-2:]
        return (h // self._patch()) * (w // self._patch())

    def _shift_mu(self, steps: int) -> float | None:
        """The dynamic time shift the pipeline passes to its scheduler for ``steps`` steps; None: the
        scheduler config's line in the number of image tokens (FLUX.1, Qwen-Image, Z-Image)."""
        return None

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
        context_parallel.check(self.context_parallel)  # before the pipeline loads
        self.device = dx.resolve_device(self.device)
        self._torch_dtype = dx.parse_dtype(self.dtype)
        if self._pipeline is None:
            self._pipeline = self._load()
        pipe = self._pipeline
        self._check_pipeline(pipe)
        self._place()
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        dx.freeze(*self.modules())
        for _, transformer in self.trained_transformers():
            self.make_trainable(transformer)
        if self.lora is not None and self.lora_path is not None:
            self.load_trainable_state_dict(self._read_adapter(self.lora_path))
        if self.vae_tiling and hasattr(pipe.vae, "enable_tiling"):
            pipe.vae.enable_tiling()
        self._cache = dx.PromptCache(self.prompt_cache_size)
        truncating = bool(pipe.scheduler.config.get("use_flow_sigmas")) and not _is_euler(pipe.scheduler)
        self._integer_timesteps = truncating if self.integer_timesteps is None else bool(self.integer_timesteps)
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
        self.context_parallel_size = context_parallel.enable_on(pipe, self.context_parallel)

    # --- what the policy is made of -------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        return self._pipeline

    @property
    def transformer(self) -> ModelMixin:
        return self._pipeline.transformer

    def trained_transformers(self) -> list[tuple[str, ModelMixin]]:
        """(pipeline attribute, module) of every network that trains (Wan 2.2 A14B: its experts)."""
        return [("transformer", self.transformer)]

    def make_trainable(self, transformer: ModelMixin) -> None:
        """The recipe's LoRA adapter (or every weight) and gradient checkpointing on ``transformer``."""
        if self.lora is not None:
            inject_lora(transformer, self.lora)
        else:
            transformer.requires_grad_(True)
        if self.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()

    def _single_transformer(self) -> bool:
        """State keys and exports keep the plain one-transformer layout (no module prefix)."""
        return [name for name, _ in self.trained_transformers()] == ["transformer"]

    @property
    def trainable_module(self) -> torch.nn.Module:
        """What a sharded (FSDP) run splits: the transformer, one unit per block (``_no_split_modules``)."""
        return self.transformer

    @property
    def text_device(self) -> torch.device:
        return dx.resolve_device(self.text_encoder_device if self.text_encoder_device is not None else self.device)

    # --- loading: where each network goes (fgrpo.models.load_plan) --------------------------------

    @classmethod
    def planned_components(cls, keys: Mapping[str, Any]) -> tuple[str, ...]:
        """The networks of this backbone's pipelines, before one is loaded (the load plan's default)."""
        return ("transformer", "vae", *cls.text_encoder_names)

    @classmethod
    def sharded_components(cls, keys: Mapping[str, Any], components: Sequence[str]) -> list[str]:
        """Of ``components``, those a sharded launch splits (inside :attr:`trainable_module`)."""
        return [n for n in components if n == "transformer"]

    def load_plan(self, shards: bool = False) -> list[Placement]:
        """:func:`fgrpo.models.load_plan.plan` of this policy's keys and (once loaded) its pipeline."""
        keys = {f.name: getattr(self, f.name) for f in attrs.fields(type(self)) if f.init and f.alias == f.name}
        pipe = self._pipeline
        found = None if pipe is None else [n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)]
        return plan(type(self), keys, shards, found)

    def _load(self) -> Any:
        """The pipeline from ``path``, on the host; under FSDP2 or ZeRO-3 with stand-ins (:mod:`.sharded_load`)."""
        from fgrpo.core.launch import loads_shards  # a run makes its launch before its policy

        sharded = [p.name for p in self.load_plan(loads_shards()) if p.sharded]
        pipe, self._stand_ins = sharded_load.load(self, sharded)
        return pipe

    def _place(self) -> None:
        """Each network once, straight to its planned device and dtype (stand-ins are already there)."""
        filled_later = {id(s.owner) for s in self._stand_ins}
        for placement in self.load_plan():
            module = getattr(self._pipeline, placement.name)
            if any(id(m) in filled_later for m in module.modules()):
                continue
            device = self.text_device if placement.name in self.text_encoder_names else self.device
            same = getattr(module, "dtype", None) == placement.dtype  # cast only when needed: diffusers warns
            module.to(device=device, dtype=None if same else placement.dtype)

    def shard_loading(self, place: Any = None) -> AbstractContextManager[None]:
        """Around the launch's sharding of :attr:`trainable_module`: the networks loaded as stand-ins
        become this process's shards (FSDP2) or partitions (ZeRO-3's ``place``), read from their
        files (:func:`.sharded_load.sharding`); nothing after a whole load."""
        pending, self._stand_ins = self._stand_ins, []
        return sharded_load.sharding(pending, self.trainable_module, self.device, place)

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
        texts = prompts if self.text_sees_images else [media.text_of(p) for p in prompts]
        cond = self._cache.get(texts, self._encode_on_device)
        if self.cfg:
            negatives = self._negative_prompts(prompts)
            negative = self._cache.get(negatives, self._encode_on_device)
            for key, value in negative.items():
                cond[NEGATIVE + key] = value.expand(len(prompts), *value.shape[1:]) if len(negatives) == 1 else value
        cond.update(self._conditions(prompts))
        return cond

    def _encode_on_device(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        # in the encoders' own dtype, as the pipeline encodes (flow_grpo too, outside its autocast),
        # whatever autocast the rollout runs under
        with torch.autocast(self.text_device.type, enabled=False):
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
        sigmas, timesteps = dx.scheduler_grid(
            self._pipeline.scheduler,
            steps,
            shift=self.shift,
            image_seq_len=self._image_seq_len(),
            explicit_grid=self.explicit_sigma_grid,
            sigma_grid=self.sigma_grid,
            mu=self._shift_mu(steps),
        )
        if self._integer_timesteps and timesteps is not None:
            grid = dict(zip(sigmas[:-1].tolist(), timesteps.tolist(), strict=False))
            if any(self._timestep_table.get(k) != v for k, v in grid.items()):
                self._timestep_table.update(grid)
                self._timestep_tensors = None
        return sigmas.to(self.device)

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
        shared = set(self.shared_condition_keys)
        missing = [k for k in positive if NEGATIVE + k not in cond and k not in shared]
        if missing:
            raise ValueError(
                f"guidance (scale {self.cfg_scale}) needs negative embeddings in cond ({NEGATIVE}{missing[0]}): build "
                f"it with encode()"
            )
        both = {
            k: torch.cat([(v if k in shared else cond[NEGATIVE + k]).to(self.device), v.to(self.device)])
            for k, v in positive.items()
        }
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
        videos (B, T, 3, H, W), float32 in [0, 1]; ``decode_batch_size`` samples per VAE call, in
        the VAE's own dtype (``vae_dtype``) whatever autocast is active."""
        chunk = self.decode_batch_size or latents.shape[0]
        with torch.autocast(torch.device(self.device).type, enabled=False):
            parts = [self._decode(part.to(self.device)) for part in latents.split(chunk)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The LoRA weights (float32), or every transformer weight with full fine-tuning."""
        modules = [m for _, m in self.trained_transformers()]
        if self.lora is None:
            return [p for m in modules for p in m.parameters()]
        return [p for m in modules for p in m.parameters() if p.requires_grad]

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen base model: the LoRA adapter disabled inside, re-enabled exactly after."""
        if self.lora is None:
            raise RuntimeError(
                "model.reference(): full fine-tuning (model.lora null or rank 0) keeps no frozen reference; "
                "use a LoRA adapter (model.lora.rank > 0) or an objective without a KL term (beta 0)"
            )
        from contextlib import ExitStack

        with ExitStack() as stack:
            for _, transformer in self.trained_transformers():
                stack.enter_context(adapters_disabled(transformer))
            yield

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies: the LoRA weights (peft names) or the transformer's full state dict;
        with several trained networks each key starts with its pipeline attribute
        (``transformer.``, ``transformer_2.``)."""
        lora = self.lora is not None
        if self._single_transformer():
            return trainable_state(self.transformer, lora=lora)
        return {
            f"{name}.{k}": v
            for name, m in self.trained_transformers()
            for k, v in trainable_state(m, lora=lora).items()
        }

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        lora = self.lora is not None
        if self._single_transformer():
            load_trainable_state(self.transformer, state, lora=lora)
            return
        names = [name for name, _ in self.trained_transformers()]
        unknown = sorted(k for k in state if k.split(".", 1)[0] not in names)
        if unknown:
            raise ValueError(
                f"trainable state: keys of no trained network {unknown[:3]} (trained: {', '.join(names)})"
            )
        for name, module in self.trained_transformers():
            prefix = name + "."
            load_trainable_state(
                module, {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, lora=lora
            )

    def _read_adapter(self, path: str) -> dict[str, torch.Tensor]:
        """``lora_path``'s weights as :meth:`load_trainable_state_dict` takes them: one adapter file
        (fgrpo's, peft's or diffusers'), or with several trained networks a folder of
        :meth:`export`'s files (or fgrpo's own prefixed ``trainable.safetensors``)."""
        import os

        if self._single_transformer():
            return read_lora_file(path)
        own = os.path.join(path, "trainable.safetensors") if os.path.isdir(path) else path
        if os.path.isfile(own) and own.endswith("trainable.safetensors"):
            from safetensors.torch import load_file

            return load_file(own)
        state = {}
        for name, _ in self.trained_transformers():
            file = os.path.join(path, lora_file_name(name))
            if not os.path.isfile(file):
                raise FileNotFoundError(
                    f"lora_path {path!r}: no {lora_file_name(name)} for the {name} this recipe trains"
                )
            state.update({f"{name}.{k}": v for k, v in read_lora_file(file).items()})
        return state

    # --- export ---------------------------------------------------------------------------------

    @property
    def export_in_checkpoints(self) -> bool:
        """Checkpoints also hold :meth:`export`'s files (a LoRA is small; a full transformer is not)."""
        return self.lora is not None

    def export(self, folder: str, state: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """The trained weights in diffusers' own format: the adapter as the pipeline's
        ``save_lora_weights`` writes it (``pipe.load_lora_weights(folder)`` loads it with its
        rank and alpha) and, in the same folder, as peft's ``save_pretrained`` writes it
        (``PeftModel.from_pretrained(transformer, folder)``), or with full fine-tuning the transformer's
        ``save_pretrained`` in ``folder/transformer``. A second trained network (Wan 2.2's low-noise
        expert) writes ``pytorch_lora_weights_transformer_2.safetensors`` (``pipe.load_lora_weights(folder,
        weight_name=..., load_into_transformer_2=True)``) and its peft adapter in ``folder/transformer_2``,
        or ``folder/transformer_2``. ``state``: a LoRA's :meth:`trainable_state_dict` to write instead
        of the transformer's current adapter (a sharded run gathers it first). Returns the files
        written."""
        import os

        if self.lora is not None:
            if self._single_transformer():
                return [
                    save_diffusers_lora(type(self._pipeline), self.transformer, folder, state)
                ] + save_peft_adapter(self.transformer, folder, state)
            written = []
            for name, module in self.trained_transformers():
                prefix = name + "."
                part = (
                    None if state is None else {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
                )
                written.append(
                    save_diffusers_lora(type(self._pipeline), module, folder, part, weight_name=lora_file_name(name))
                )
                written += save_peft_adapter(
                    module, folder if name == "transformer" else os.path.join(folder, name), part
                )
            return written
        if state is not None:
            raise ValueError("export(state=...) takes LoRA weights; a fully fine-tuned transformer exports its own")
        written = []
        for name, module in self.trained_transformers():
            target = os.path.join(folder, name)
            module.save_pretrained(target)
            written += sorted(os.path.join(target, f) for f in os.listdir(target))
        return written


__all__ = ["DiffusersPolicy", "NEGATIVE"]
