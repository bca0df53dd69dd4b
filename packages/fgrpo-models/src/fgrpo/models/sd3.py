"""Stable Diffusion 3 / 3.5 as an fgrpo policy: a diffusers ``StableDiffusion3Pipeline`` with a
peft LoRA adapter on its transformer.

Conventions (checked in tests against ``pipe(..., output_type="latent")``):

- Latents are the pipeline's own: the VAE latent normalised as ``(z - shift_factor) *
  scaling_factor``, shape (B, 16, H/8, W/8); :meth:`SD3Policy.decode` undoes it exactly as the
  pipeline does (``z = x / scaling_factor + shift_factor``, VAE decode, ``x/2 + 0.5`` clamped).
- ``velocity(x, sigma, cond)`` is the transformer output as is: v = eps - x0 (what
  ``FlowMatchEulerDiscreteScheduler.step`` integrates as ``x' = x + (sigma' - sigma) * v``, the
  ``ode`` kernel). The transformer is called with ``timestep = sigma * num_train_timesteps``
  (1000), in float32, as the pipeline does. Classifier-free guidance (``guidance_scale > 1``):
  one doubled forward [uncond; cond], v = v_u + s * (v_c - v_u), the negative prompt being the
  empty prompt, as in the pipeline. The result is cast to float32 (kernels work in float32)
  whatever the model dtype.
- ``sigmas(steps)`` is the pipeline scheduler's own schedule (a copy of it with ``shift``, so
  it matches ``pipe(num_inference_steps=steps)`` exactly), steps + 1 values ending in 0.

diffusers is imported lazily (inside the methods), so listing plugins never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx

#: LoRA on both attention streams of every joint block (image: to_*; text: add_*/to_add_out),
#: as flow_grpo does for SD3.5 (r 32, alpha 64).
SD3_LORA_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)


def _positive_int_or_none(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"got {value!r}; allowed: a positive integer or null")


@attrs.define(eq=False)
class SD3Policy:
    """SD3/SD3.5 (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`.

    Build it from a recipe (``path``) or around an existing pipeline with :meth:`from_pipeline`
    (tests, tools). The policy owns the pipeline: it moves it to ``device``/``dtype``, freezes the
    VAE and text encoders and adds the LoRA adapter to ``pipeline.transformer`` in place.

    ``reference()`` disables the adapter (no second copy of the network). With full fine-tuning
    (``lora: null`` or rank 0) there is no frozen reference and ``reference()`` raises: use LoRA,
    or an objective without a KL term.
    """

    path: str = param(help="hub id or local folder of a StableDiffusion3Pipeline")
    dtype: str = param(
        "float32",
        choices=dx.DTYPE_CHOICES,
        help="weights dtype of the whole pipeline (the LoRA weights stay float32)",
    )
    device: str | torch.device = param("auto", validator=dx.check_device, help=dx.DEVICE_HELP)
    resolution: int | None = param(
        None,
        validator=_positive_int_or_none,
        help="image height = width in pixels; null: transformer sample_size x VAE scale factor",
    )
    guidance_scale: float = param(
        1.0, ge=1.0, help="classifier-free guidance scale; 1 = off, > 1 doubles the forward (NFE 2 per call)"
    )
    max_sequence_length: int = param(256, ge=1, le=512, help="T5 tokens per prompt")
    lora: dict | None = param(
        factory=lambda: {"rank": 32, "alpha": 64, "target_modules": list(SD3_LORA_TARGETS), "init": "default"},
        converter=dx.lora_converter(32, 64, SD3_LORA_TARGETS),
        help="{rank, alpha, target_modules, init: default|gaussian|random}; null or rank 0: full fine-tuning",
    )
    lora_path: str | None = param(None, help="adapter weights to load (.safetensors file or folder)")
    shift: float | None = param(None, gt=0, help="time shift of sigmas(steps); null: the pipeline scheduler's (3.0 for SD3)")
    gradient_checkpointing: bool = param(False, help="recompute transformer blocks in backward to save memory")
    prompt_cache_size: int = param(1024, ge=0, help="prompts whose embeddings are kept on device (LRU); 0: no cache")

    _pipeline: Any = attrs.field(default=None, repr=False, alias="pipeline")
    _cache: dx.PromptCache = attrs.field(init=False, repr=False)
    _torch_dtype: torch.dtype = attrs.field(init=False, repr=False)
    _latent_shape: tuple[int, int, int] = attrs.field(init=False, repr=False)

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_pipeline(cls, pipeline: Any, **keys: Any) -> SD3Policy:
        """Wrap an already built ``StableDiffusion3Pipeline`` (taken over and modified in place)."""
        path = keys.pop("path", None) or getattr(pipeline, "name_or_path", None) or "<in-memory pipeline>"
        return cls(path=str(path), pipeline=pipeline, **keys)

    def __attrs_post_init__(self) -> None:
        if self.lora is None and self.lora_path is not None:
            raise ValueError("model.lora_path needs a LoRA adapter; set model.lora (rank > 0)")
        self.device = dx.resolve_device(self.device)
        self._torch_dtype = dx.parse_dtype(self.dtype)
        if self._pipeline is None:
            self._pipeline = self._load(self.path)
        pipe = self._pipeline
        if any(m.dtype != self._torch_dtype for m in _modules(pipe)):
            pipe.to(dtype=self._torch_dtype)  # only when needed: diffusers warns on every cast
        pipe.to(self.device)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)
        transformer = pipe.transformer
        dx.freeze(*_modules(pipe))
        if self.lora is not None:
            dx.inject_lora(transformer, self.lora)
            if self.lora_path is not None:
                self.load_trainable_state_dict(dx.read_lora_file(self.lora_path))
        else:
            transformer.requires_grad_(True)
        if self.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self._cache = dx.PromptCache(self.prompt_cache_size)

        scale = self.vae_scale_factor
        multiple = scale * int(transformer.config.patch_size)
        resolution = self.resolution or int(transformer.config.sample_size) * scale
        if resolution % multiple:
            raise ValueError(f"model.resolution: got {resolution}; must be a multiple of {multiple} (VAE scale x patch size)")
        self.resolution = resolution
        side = resolution // scale
        self._latent_shape = (int(transformer.config.in_channels), side, side)
        if self.shift is None:
            self.shift = float(pipe.scheduler.config.get("shift", 1.0))

    def _load(self, path: str) -> Any:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline.from_pretrained(path, **dx.from_pretrained_dtype_kwargs(self._torch_dtype))

    # --- what the policy is made of -------------------------------------------------------------

    @property
    def pipeline(self) -> Any:
        return self._pipeline

    @property
    def transformer(self) -> torch.nn.Module:
        return self._pipeline.transformer

    @property
    def vae_scale_factor(self) -> int:
        return int(getattr(self._pipeline, "vae_scale_factor", 2 ** (len(self._pipeline.vae.config.block_out_channels) - 1)))

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one latent."""
        return self._latent_shape

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def evaluations_per_call(self) -> int:
        return 2 if self.cfg else 1

    @property
    def prompt_cache(self) -> dx.PromptCache:
        return self._cache

    # --- Policy -----------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """{prompt_embeds (B, L, D), pooled_prompt_embeds (B, P)} (+ ``negative_*`` with CFG).

        Embeddings come from ``pipeline.encode_prompt`` (CLIP-L, CLIP-G, T5), computed once per
        distinct prompt string and cached (LRU, ``prompt_cache_size``); the negative is the empty
        prompt's embedding, repeated (an expanded view) over the batch.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        cond = self._cache.get(prompts, self._encode_uncached)
        if self.cfg:
            neg = self._cache.get([""], self._encode_uncached)
            n = len(prompts)
            cond["negative_prompt_embeds"] = neg["prompt_embeds"].expand(n, *neg["prompt_embeds"].shape[1:])
            cond["negative_pooled_prompt_embeds"] = neg["pooled_prompt_embeds"].expand(
                n, *neg["pooled_prompt_embeds"].shape[1:]
            )
        return cond

    def _encode_uncached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self._pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def initial_noise(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Standard normal latents (n, 16, H/8, W/8), float32 on ``device`` (drawn like the pipeline's
        ``prepare_latents``: on the generator's device, then moved)."""
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor((n, *self._latent_shape), generator=generator, device=self.device, dtype=torch.float32)

    def sigmas(self, steps: int) -> torch.Tensor:
        """The scheduler's sigmas for ``steps`` steps with time shift ``shift``: (steps + 1,) float32
        on ``device``, from 1 down to 0 (``FlowMatchEulerDiscreteScheduler.set_timesteps``)."""
        if steps < 1:
            raise ValueError(f"steps: got {steps}; must be >= 1")
        base = self._pipeline.scheduler
        config = dict(base.config)
        overrides: dict[str, Any] = {"shift": self.shift}
        kwargs: dict[str, Any] = {}
        if config.get("use_dynamic_shifting"):
            if self.shift != float(config.get("shift", 1.0)):
                overrides["use_dynamic_shifting"] = False  # an explicit shift wins
            else:
                kwargs["mu"] = self._dynamic_shift_mu(config)
        scheduler = type(base).from_config(config, **overrides)
        scheduler.set_timesteps(steps, device="cpu", **kwargs)
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

    def _dynamic_shift_mu(self, config: Mapping[str, Any]) -> float:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        patch = int(self.transformer.config.patch_size)
        _, h, w = self._latent_shape
        return calculate_shift(
            (h // patch) * (w // patch),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.16),
        )

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """v = eps - x0 predicted at noise level ``sigma`` ((B,) or a scalar), float32, CFG applied."""
        transformer = self._pipeline.transformer
        dtype = transformer.dtype
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        sigma = sigma.expand(b) if sigma.ndim == 0 else sigma.reshape(b)
        timestep = sigma * float(self._pipeline.scheduler.config.get("num_train_timesteps", 1000))
        hidden = x.to(self.device, dtype)
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if self.cfg:
            if "negative_prompt_embeds" not in cond:
                raise ValueError("guidance_scale > 1 needs negative embeddings in cond: build it with encode()")
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        out = transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=embeds.to(self.device, dtype),
            pooled_projections=pooled.to(self.device, dtype),
            return_dict=False,
        )[0].float()
        if self.cfg:
            uncond, text = out.chunk(2)
            out = uncond + self.guidance_scale * (text - uncond)
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W), float32 in [0, 1], as ``pipe(..., output_type="pt")`` makes them."""
        vae = self._pipeline.vae
        z = latents.to(self.device, vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The LoRA weights (float32), or every transformer weight with full fine-tuning."""
        return [p for p in self.transformer.parameters() if p.requires_grad] if self.lora is not None else list(
            self.transformer.parameters()
        )

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen base model: the LoRA adapter disabled inside, re-enabled exactly after."""
        if self.lora is None:
            raise RuntimeError(
                "model.reference(): full fine-tuning (model.lora null or rank 0) keeps no frozen reference; "
                "use a LoRA adapter (model.lora.rank > 0) or an objective without a KL term (beta 0)"
            )
        with dx.adapters_disabled(self.transformer):
            yield

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies: the LoRA weights (peft names) or the transformer's full state dict."""
        return dx.trainable_state(self.transformer, lora=self.lora is not None)

    def load_trainable_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        dx.load_trainable_state(self.transformer, state, lora=self.lora is not None)


def _modules(pipe: Any) -> list[torch.nn.Module]:
    names = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    return [m for m in (getattr(pipe, n, None) for n in names) if isinstance(m, torch.nn.Module)]


__all__ = ["SD3Policy", "SD3_LORA_TARGETS"]
