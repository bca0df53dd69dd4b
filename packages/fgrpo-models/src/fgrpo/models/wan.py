"""``wan`` and ``wan-i2v``: Wan 2.1 and Wan 2.2 (diffusers ``WanPipeline``, text-to-video, and
``WanImageToVideoPipeline``) with a peft LoRA.

What differs from :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` (checked in tests
against ``pipe(..., output_type="latent")``):

- outputs are videos: ``decode`` returns frame stacks (B, T, 3, H, W) in [0, 1]
  (``num_frames`` = 4k + 1); rewards receive them (an image reward scores every k-th frame
  through the reward's ``frame_stride`` key, see fgrpo.core.scoring.score);
- the state is the video latent (B, C, (T - 1)/4 + 1, H/s, W/s), normalised per channel by
  the VAE's ``latents_mean``/``latents_std`` (Wan 2.1 and A14B: 16 channels at H/8; TI2V-5B's
  VAE: 48 channels at H/16);
- prompts: UMT5 through ``pipeline.encode_prompt``, zero-padded to ``max_sequence_length``;
- ``timestep = sigma * 1000``; classifier-free guidance (``guidance_scale``, 5 by default) with
  the negative prompt, as the pipeline does; TI2V-5B (``expand_timesteps``) takes the timestep
  per token, as its pipeline passes it;
- the schedule: the scheduler's flow-shifted sigmas. Wan ships a UniPC multistep scheduler;
  fgrpo integrates the same sigmas one (Euler or stochastic) step at a time, and gives the
  transformer the scheduler's truncated integer timesteps as the pipeline does;
- LoRA r 32 / alpha 64 with gaussian init on every attention projection (flow_grpo's Wan);
  Flow-Factory's Wan 2.2 recipes add the feed-forward (``ffn.net.0.proj``, ``ffn.net.2``).

Wan 2.2 A14B: two experts (the pipeline's ``transformer`` and ``transformer_2``). As the pipeline
decides, a row whose timestep ``t = 1000 sigma`` is at least ``boundary_ratio x 1000`` is denoised
by ``transformer`` (the high-noise expert) with ``guidance_scale``, the other rows by
``transformer_2`` (the low-noise expert) with ``guidance_scale_2``; ``velocity`` routes every
row of a batch (a trained step's batch may hold both kinds). ``train_experts`` says which
experts get a LoRA (or train whole): both by default, as Flow-Factory does; an untrained expert
stays the frozen base. Trainable state keys, checkpoints and exports then name the expert:
``transformer.<key>`` / ``transformer_2.<key>``, and the export writes
``pytorch_lora_weights.safetensors`` (the high-noise expert's: ``pipe.load_lora_weights(folder)``)
and ``pytorch_lora_weights_transformer_2.safetensors`` (``pipe.load_lora_weights(folder,
weight_name=..., load_into_transformer_2=True)``). A sampler's kernel, window and CFG act on
every step alike: a trained window that straddles the boundary trains both experts (each on its
own steps' rows), one that lies on one side trains that expert only.

``wan-i2v`` (Wan 2.2 I2V-A14B, and the same code for a one-expert I2V pipeline without a CLIP
image encoder): each prompt's source image (the prompt metadata's ``image``, see
:func:`fgrpo.core.prompts.resolve_media`) is resized to the resolution, encoded by the VAE as the
first frame of an otherwise black video, and the transformer sees ``[state, mask, image latents]``
along the channels, as the pipeline builds them; the image latents travel in ``cond``
(``image_latents``, batch first, shared by both guidance branches), the 4-channel first-frame mask
is derived inside ``velocity``. Refused: Wan 2.1 I2V (a CLIP image encoder's embeddings) and
TI2V-5B image-to-video (its pipeline overwrites the first latent frame with the image after
sampling, outside the state the kernels step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from fgrpo.core import media
from fgrpo.core.config import param
from fgrpo.core.protocols import ForwardGroups
from fgrpo.models import _diffusers as dx
from fgrpo.models.diffusers_policy import NEGATIVE, DiffusersPolicy
from fgrpo.models.lora import lora_param
from fgrpo.models.sizes import Geometry, Published

if TYPE_CHECKING:  # from its own module: mypy reads diffusers' top-level names as its dummy objects
    from diffusers.models.modeling_utils import ModelMixin

#: self- and cross-attention of every block (attn1, attn2), no feed-forward: flow_grpo's Wan adapter
#: (scripts/train_wan2_1.py:451-460; add_* exist only in image-to-video blocks). Adding
#: ffn.net.0.proj and ffn.net.2 adapts 85% more parameters on Wan 2.1 1.3B.
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
#: the recipe's names of Wan 2.2's experts -> the pipeline's attributes
EXPERTS = {"high_noise": "transformer", "low_noise": "transformer_2"}


def _frames(_inst: Any, _attribute: Any, value: Any) -> None:
    if isinstance(value, int) and (value - 1) % 4:
        raise ValueError(f"got {value!r}; allowed: 4k + 1 frames (1, 5, 9, ..., 81)")


def _experts(_inst: Any, _attribute: Any, value: Any) -> None:
    if value is None:
        return
    if (
        not isinstance(value, (list, tuple))
        or not value
        or any(v not in EXPERTS for v in value)
        or len(set(value)) != len(value)
    ):
        raise ValueError(
            f"got {value!r}; allowed: null (every expert of the pipeline) or a list of {', '.join(EXPERTS)}"
        )


class WanExperts(torch.nn.Module):
    """Wan 2.2's two experts as one module whose ``forward(name, **inputs)`` runs one of them: what a
    sharded run splits over the processes (FSDP's hooks and DeepSpeed's engine see every call)."""

    def __init__(self, experts: Mapping[str, torch.nn.Module]):
        super().__init__()
        self.experts = torch.nn.ModuleDict(dict(experts))

    def forward(self, name: str, **inputs: Any) -> Any:
        return self.experts[name](**inputs)

    @property
    def _no_split_modules(self) -> list[str]:
        """The experts' block classes: accelerate's transformer-based wrap (fsdp-lora.yaml,
        fsdp-full.yaml) reads them off the module it shards, and gives each block its own FSDP2 unit,
        as for one transformer; without them the whole module is one unit, and every forward
        gathers both experts' weights whole (``fgrpo memory``: about 56 GiB for Wan 2.2 A14B)."""
        names = (getattr(m, "_no_split_modules", None) or [] for m in self.experts.values())
        return sorted({n for found in names for n in found})


@attrs.define(eq=False)
class WanPolicy(DiffusersPolicy):
    """Wan 2.1 / 2.2 text-to-video (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "WanPipeline"
    geometry = Geometry(temporal=4)  # 4x temporal, 16x spatial (8x VAE, 2x2 patches)
    published = {
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers": Published(
            transformer=14.3e9, text=5.7e9, vae=0.13e9, hidden=5120, layers=40, experts=2
        ),
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers": Published(
            transformer=14.3e9, text=5.7e9, vae=0.13e9, hidden=5120, layers=40, experts=2
        ),
        # TI2V-5B's VAE compresses 16x, its patches 2x2: 32 px a token, 48 channels x 4
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": Published(
            transformer=5.0e9,
            text=5.7e9,
            vae=0.7e9,
            hidden=3072,
            layers=30,
            geometry=Geometry(spatial=32, temporal=4, values_per_token=192),
        ),
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": Published(
            transformer=1.42e9,
            text=5.7e9,
            vae=0.13e9,
            hidden=1536,
            layers=30,
            config=dict(
                patch_size=(1, 2, 2),
                num_attention_heads=12,
                attention_head_dim=128,
                in_channels=16,
                out_channels=16,
                text_dim=4096,
                freq_dim=256,
                ffn_dim=8960,
                num_layers=30,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                eps=1e-6,
                rope_max_seq_len=1024,
            ),
            source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json",
        ),
    }
    text_encoder_names = ("text_encoder",)
    timestep_scale = 1000.0

    guidance_scale: float = param(
        5.0,
        ge=1.0,
        help="classifier-free guidance scale (Wan 2.2: of the high-noise expert); 1 = off, > 1: NFE 2 per call",
    )
    guidance_scale_2: float | None = param(
        None, ge=1.0, help="Wan 2.2: the low-noise expert's guidance scale; null: guidance_scale"
    )
    train_experts: list[str] | None = param(
        None,
        validator=_experts,
        help="Wan 2.2 A14B: which experts train (high_noise, low_noise); null: every expert of the pipeline",
    )
    num_frames: int = param(81, ge=1, validator=_frames, help="frames per video (4k + 1)")
    max_sequence_length: int = param(512, ge=1, help="UMT5 tokens per prompt (zero-padded)")
    decode_batch_size: int = param(1, ge=0, help="videos per VAE decode call; 0: the whole batch at once")
    lora: dict | None = lora_param(32, WAN_LORA_TARGETS, init="gaussian")

    _experts_module: WanExperts | None = attrs.field(init=False, default=None, repr=False)
    _active: str = attrs.field(init=False, default="transformer", repr=False)

    # --- the experts ----------------------------------------------------------------------------

    @property
    def boundary_ratio(self) -> float | None:
        """Wan 2.2 A14B's switch between its experts (None: one transformer)."""
        if getattr(self._pipeline, "transformer_2", None) is None:
            return None
        return getattr(self._pipeline.config, "boundary_ratio", None)

    @property
    def is_moe(self) -> bool:
        return self.boundary_ratio is not None

    def high_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """Per row: whether the pipeline runs the high-noise expert (``transformer``) at ``sigma``:
        the timestep it gives the network there (``sigma * 1000``, or UniPC's truncated integer)
        is at least ``boundary_ratio * num_train_timesteps``."""
        if not self.is_moe:
            return torch.ones_like(sigma, dtype=torch.bool)
        boundary = self.boundary_ratio * self._pipeline.scheduler.config.num_train_timesteps
        return self._timestep(sigma.to(torch.float32)) >= boundary

    @property
    def forward_groups(self) -> ForwardGroups | None:
        """Wan 2.2 A14B: a row runs through the high-noise expert (group 0) or the low-noise one
        (group 1), in that order (:meth:`velocity`); sigma 1 is the high-noise expert's (timestep
        1000), sigma 0 the low-noise one's. A sharded update keeps every process on the same expert
        (:mod:`fgrpo.core.points.lockstep`)."""
        if not self.is_moe:
            return None
        return ForwardGroups(of=lambda sigma: (~self.high_noise(sigma)).long(), levels=(1.0, 0.0))

    def trained_transformers(self) -> list[tuple[str, ModelMixin]]:
        if not self.is_moe:
            return [("transformer", self.transformer)]
        names = [EXPERTS[e] for e in (self.train_experts or EXPERTS)]
        return [(n, getattr(self._pipeline, n)) for n in ("transformer", "transformer_2") if n in names]

    @property
    def trainable_module(self) -> torch.nn.Module:
        """One transformer, or Wan 2.2's :class:`WanExperts` (every forward goes through it)."""
        return self._experts_module if self._experts_module is not None else self.transformer

    def modules(self) -> list[torch.nn.Module]:
        second = getattr(self._pipeline, "transformer_2", None)
        return super().modules() + ([second] if isinstance(second, torch.nn.Module) else [])

    @classmethod
    def planned_components(cls, keys: Mapping[str, Any]) -> tuple[str, ...]:
        """Wan 2.2 A14B's low-noise expert too (absent from Wan 2.1 and TI2V-5B folders)."""
        return ("transformer", "transformer_2", *super().planned_components(keys)[1:])

    @classmethod
    def sharded_components(cls, keys: Mapping[str, Any], components: Sequence[str]) -> list[str]:
        """Both experts: :class:`WanExperts`, which a sharded launch splits, holds the frozen one too."""
        return [n for n in components if n in ("transformer", "transformer_2")]

    def _check_pipeline(self, pipe: Any) -> None:
        if getattr(pipe, "transformer", None) is None:
            raise ValueError(
                "model.path: this Wan pipeline has no transformer (a low-noise expert alone); fgrpo drives it with "
                "its transformer"
            )
        moe = (
            getattr(pipe, "transformer_2", None) is not None
            and getattr(pipe.config, "boundary_ratio", None) is not None
        )
        if self.train_experts is not None and not moe and self.train_experts != ["high_noise"]:
            raise ValueError(
                f"model.train_experts: got {self.train_experts!r} but this pipeline has one transformer (Wan 2.1, "
                f"TI2V-5B); "
                "allowed: null or [high_noise]"
            )
        if moe:
            self._experts_module = WanExperts({"transformer": pipe.transformer, "transformer_2": pipe.transformer_2})

    def _forward(self, **inputs: Any) -> Any:
        if self._experts_module is not None:
            return self._experts_module(self._active, **inputs)
        return self.transformer(**inputs)

    @property
    def cfg_scale(self) -> float:
        if self._active == "transformer_2" and self.guidance_scale_2 is not None:
            return self.guidance_scale_2
        return self.guidance_scale

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0  # the pipeline's rule: guidance_scale_2 alone turns nothing on

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """v at ``sigma`` ((B,) or a scalar); Wan 2.2 A14B: each row from the expert its noise level
        selects (one forward per expert present in the batch)."""
        if not self.is_moe:
            return super().velocity(x, sigma, cond)
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        sigma = sigma.expand(b) if sigma.ndim == 0 else sigma.reshape(b)
        high = self.high_noise(sigma)
        parts, order = [], []
        for name, rows in (("transformer", high.nonzero().flatten()), ("transformer_2", (~high).nonzero().flatten())):
            if rows.numel() == 0:
                continue
            self._active = name
            try:
                parts.append(super().velocity(x[rows], sigma[rows], {k: v[rows] for k, v in cond.items()}))
            finally:
                self._active = "transformer"
            order.append(rows)
        if len(parts) == 1:
            return parts[0]
        inverse = torch.empty(b, dtype=torch.long, device=self.device)
        inverse[torch.cat(order)] = torch.arange(b, device=self.device)
        return torch.cat(parts)[inverse]

    # --- the network's inputs -------------------------------------------------------------------

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, _ = self._pipeline.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=device,
        )
        return {"prompt_embeds": embeds}

    def _token_timesteps(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The timestep per row (:meth:`_timestep`), or per token (B, frames x h/2 x w/2) for
        TI2V-5B, as its pipeline passes it."""
        t = self._timestep(sigma)
        if not getattr(self._pipeline.config, "expand_timesteps", False):
            return t
        frames, h, w = x.shape[-3:]
        return t[:, None].expand(x.shape[0], frames * ((h + 1) // 2) * ((w + 1) // 2))

    def _network_input(self, x: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return x

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        dtype = self.transformer.dtype
        return self._forward(
            hidden_states=self._network_input(x, cond).to(dtype),
            timestep=self._token_timesteps(x, sigma),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0].float()

    def _normalisation(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel (mean, 1 / std) of normalised latents, shaped to broadcast."""
        vae = self._pipeline.vae
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
        return mean, inv_std

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self._pipeline.vae
        z = latents.to(vae.dtype)
        mean, inv_std = self._normalisation(z)
        return dx.video_frames(vae.decode(z / inv_std + mean, return_dict=False)[0])

    @property
    def vae_scale_factor(self) -> int:
        return int(self._pipeline.vae_scale_factor_spatial)

    def _latent_shape_for(self, height: int, width: int) -> tuple[int, int, int, int]:
        return dx.video_latent_shape(self._pipeline, self._pipeline.vae.config.z_dim, self.num_frames, height, width)

    def _default_size(self) -> tuple[int, int]:
        return 480, 832  # the pipeline's defaults

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * int(self.transformer.config.patch_size[-1])

    def _image_seq_len(self) -> int:
        t, h, w = self._latent_shape[-3:]
        p = self.transformer.config.patch_size
        return (t // p[0]) * (h // p[1]) * (w // p[2])


@attrs.define(eq=False)
class WanImageToVideoPolicy(WanPolicy):
    """Wan 2.2 image-to-video (diffusers ``WanImageToVideoPipeline``) with LoRA; each prompt's
    metadata names its source image (``image``); satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "WanImageToVideoPipeline"
    shared_condition_keys = ("image_latents",)
    source_image_count: ClassVar[tuple[int, int]] = (1, 1)  # the first frame (fgrpo.core.media)

    _metadata: Callable[[str], Mapping[str, Any]] | None = attrs.field(init=False, default=None, repr=False)
    _images: dx.PromptCache = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._images = dx.PromptCache(self.prompt_cache_size)

    def _check_pipeline(self, pipe: Any) -> None:
        super()._check_pipeline(pipe)
        if getattr(pipe.config, "expand_timesteps", False):
            raise ValueError(
                "model.path: TI2V-5B image-to-video (expand_timesteps) overwrites the first latent frame with the "
                "image after "
                "sampling, outside the state fgrpo's kernels step; train TI2V-5B text-to-video with the wan backbone"
            )
        if pipe.transformer.config.get("image_dim") is not None:
            raise ValueError(
                "model.path: a Wan 2.1 image-to-video pipeline (CLIP image embeddings, image_dim set); wan-i2v drives "
                "Wan 2.2 "
                "I2V (the source image through the VAE only)"
            )

    # --- where the source images come from ------------------------------------------------------

    def use_prompt_metadata(self, lookup: Callable[[str], Mapping[str, Any]]) -> None:
        """The prompt source's metadata: each prompt's ``image`` (a file path) is its first frame."""
        self._metadata = lookup

    def _image_path(self, prompt: str) -> Any:
        """The prompt's source image: the one it carries (:class:`fgrpo.core.media.Prompt`), else
        its metadata's ``image``."""
        images = media.source_images(prompt)
        if images:
            return images[0]
        value = (self._metadata(prompt) if self._metadata is not None else {}).get("image")
        return value if isinstance(value, str) and value else None

    def check_prompts(self, prompts: Sequence[str]) -> list[str]:
        import os

        problems = []
        for prompt in dict.fromkeys(prompts):
            path = self._image_path(prompt)
            if path is None:
                problems.append(
                    f"{prompt!r} names no source image: image-to-video needs an 'image' key in its metadata (a .jsonl "
                    f"row)"
                )
            elif isinstance(path, str) and not os.path.isfile(path):
                problems.append(f"{prompt!r}: its image {path!r} does not exist")
        return problems

    def _conditions(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        return self._images.get(prompts, self._encode_images)

    def _encode_images(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The normalised VAE latents (B, C, frames, h, w) of each prompt's image as the first frame
        of a black video: the pipeline's ``prepare_latents``."""
        from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

        missing = [p for p in prompts if self._image_path(p) is None]
        if missing:
            raise ValueError(f"wan-i2v: prompt {missing[0]!r} names no source image (its metadata's 'image')")
        pipe, (height, width) = self._pipeline, self._size
        vae = pipe.vae
        rows = []
        for prompt in prompts:
            image = pipe.video_processor.preprocess(
                media.load_image(self._image_path(prompt)), height=height, width=width
            )
            image = image.to(self.device, torch.float32).unsqueeze(2)
            video = torch.cat([image, image.new_zeros(1, 3, self.num_frames - 1, height, width)], dim=2)
            latent = retrieve_latents(vae.encode(video.to(vae.dtype)), sample_mode="argmax").float()
            mean, inv_std = self._normalisation(latent)
            rows.append((latent - mean) * inv_std)
        return {"image_latents": torch.cat(rows)}

    def _network_input(self, x: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[state, first-frame mask (4 channels: the first video frame's 4 temporal slots), image
        latents] along the channels, as the pipeline concatenates ``latents`` and ``condition``."""
        b, _, frames, h, w = x.shape
        temporal = int(self._pipeline.vae_scale_factor_temporal)
        mask = x.new_zeros(b, temporal, frames, h, w)
        mask[:, :, 0] = 1.0
        return torch.cat([x, mask, cond["image_latents"].to(x)], dim=1)


__all__ = ["EXPERTS", "NEGATIVE", "WAN_LORA_TARGETS", "WanExperts", "WanImageToVideoPolicy", "WanPolicy"]
