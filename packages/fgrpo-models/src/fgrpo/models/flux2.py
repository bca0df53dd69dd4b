"""``flux2`` and ``flux2-klein``: FLUX.2 [dev] (diffusers ``Flux2Pipeline``) and FLUX.2 [klein]
(``Flux2KleinPipeline``) with a peft LoRA.

What differs from :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` (checked in tests
against ``pipe(..., output_type="latent")``):

- the state is the pipeline's own latent: the VAE latent (32 channels at H/8) patchified 2x2
  into (B, 128, H/16, W/16) and normalised by the VAE's batch-norm statistics; the transformer
  sees its H/16 x W/16 positions as tokens (no packing of channels). Its position ids (4 axes:
  time, height, width, layer) for image and text tokens are derived from the shapes inside
  ``velocity``;
- prompts: [dev] runs Mistral Small 3.1 on the pipeline's chat template (system message +
  prompt), [klein] Qwen3 on its chat template; both stack three hidden layers
  (``text_encoder_out_layers``: (10, 20, 30) and (9, 18, 27)) into ``prompt_embeds`` of
  ``max_sequence_length`` tokens (padding included, as the pipelines attend to it);
- guidance: [dev] is guidance-distilled: ``guidance_scale`` feeds the transformer's guidance
  embedding (one forward per call; the pipeline has no true CFG). [klein] base models use true
  classifier-free guidance with the empty negative prompt (``guidance_scale`` > 1: NFE 2); the
  step-distilled [klein] models (``is_distilled`` in the pipeline config) ignore it, as the
  pipeline does;
- ``timestep = sigma``; the schedule is ``linspace(1, 1/steps, steps)`` shifted by the
  pipeline's empirical ``mu``, which depends on the number of image tokens *and* of steps
  (``compute_empirical_mu``), unless ``shift`` fixes it;
- ``decode`` undoes the batch-norm normalisation and the 2x2 patchify, then the VAE decodes;
- LoRA r 64 / alpha 128 on Flow-Factory's default targets: both attention streams and both
  feed-forwards of the double-stream blocks and the fused QKV-MLP projection of the
  single-stream blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.models.diffusers_policy import DiffusersPolicy
from fgrpo.models.lora import JOINT_ATTENTION_LORA_TARGETS, lora_param
from fgrpo.models.sizes import Geometry, Published, guidance_forwards

#: Flow-Factory's default FLUX.2 targets (models/flux/flux2.py ``default_target_modules``): the
#: double-stream blocks' attention (both streams) and feed-forwards, and the single-stream blocks'
#: fused projection (their output projection is ``attn.to_out``, which the list does not name)
FLUX2_LORA_TARGETS = (
    *JOINT_ATTENTION_LORA_TARGETS,
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)


def _layers(_inst: Any, _attribute: Any, value: Any) -> None:
    if not (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"got {value!r}; allowed: a non-empty list of hidden-layer indices of the text encoder")


@attrs.define(eq=False)
class Flux2Policy(DiffusersPolicy):
    """FLUX.2 [dev] (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "Flux2Pipeline"
    geometry = Geometry(values_per_token=128)  # 32 VAE channels in 2x2 patches
    published = {
        "black-forest-labs/FLUX.2-dev": Published(transformer=32.2e9, text=24.0e9, vae=0.08e9, hidden=6144, layers=56)
    }

    @classmethod
    def forwards_per_sample(cls, keys: Mapping[str, Any]) -> int:
        """One forward: FLUX.2 [dev]'s guidance is embedded."""
        return guidance_forwards(keys.get("true_cfg_scale"))

    text_encoder_names = ("text_encoder",)
    timestep_scale = 1.0
    explicit_sigma_grid = True

    guidance_scale: float = param(
        4.0, ge=0.0, help="embedded guidance of the guidance-distilled FLUX.2 [dev] (one forward per call)"
    )
    max_sequence_length: int = param(512, ge=1, help="text tokens per prompt (the chat template's included)")
    text_encoder_out_layers: list[int] = param(
        factory=lambda: [10, 20, 30],
        validator=_layers,
        help="text-encoder hidden layers stacked into the prompt embedding",
    )
    lora: dict | None = lora_param(64, FLUX2_LORA_TARGETS)

    @property
    def cfg_scale(self) -> float:
        return 1.0

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, _ = self._pipeline.encode_prompt(
            prompt=prompts,
            device=device,
            max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=tuple(self.text_encoder_out_layers),
        )
        return {"prompt_embeds": embeds}

    def _guidance(self, batch: int) -> torch.Tensor | None:
        if not self.transformer.config.guidance_embeds:
            return None
        return torch.full((batch,), self.guidance_scale, device=self.device, dtype=torch.float32)

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        embeds = cond["prompt_embeds"]
        pipe = self._pipeline
        as_given = {
            "guidance": self._guidance(x.shape[0]),
            "txt_ids": pipe._prepare_text_ids(embeds).to(self.device),
            "img_ids": pipe._prepare_latent_ids(x).to(self.device),
        }
        tokens = x.flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, C): the pipeline's _pack_latents
        return self._transformer_output(tokens, sigma, as_given, encoder_hidden_states=embeds)

    def _to_state(self, out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], *self._latent_shape[-2:])

    def _shift_mu(self, steps: int) -> float:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len=self._image_seq_len(), num_steps=steps)

    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vae = self._pipeline.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def _vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """States -> the VAE's latents (B, C, H/8, W/8), as the pipelines denormalise and unpatchify."""
        mean, std = self._bn_stats(latents)
        return self._pipeline._unpatchify_latents(latents * std + mean)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self._pipeline.vae
        image = vae.decode(self._vae_latents(latents.to(vae.dtype)), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def to_pipeline_latents(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the pipeline's ``latents=`` is the patchified latent, packed by the pipeline itself

    def from_pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self._to_state(latents)  # output_type="latent": tokens (B, h*w, C)

    def _latent_shape_for(self, height: int, width: int) -> tuple[int, int, int]:
        scale = 2 * self.vae_scale_factor
        return (int(self.transformer.config.in_channels), height // scale, width // scale)

    def _size_multiple(self) -> int:
        return 2 * self.vae_scale_factor

    def _image_seq_len(self) -> int:
        h, w = self._latent_shape[-2:]
        return h * w

    def _default_size(self) -> tuple[int, int]:
        side = int(self._pipeline.default_sample_size) * self.vae_scale_factor
        return side, side


@attrs.define(eq=False)
class Flux2KleinPolicy(Flux2Policy):
    """FLUX.2 [klein] (diffusers ``Flux2KleinPipeline``) with LoRA; satisfies
    :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "Flux2KleinPipeline"
    published = {
        name: Published(
            transformer=9.1e9,
            text=8.2e9,
            vae=0.08e9,
            hidden=4096,
            layers=32,
            # not read from the published file (no network here): the structure its sizes give, 8 double
            # and 24 single blocks of 32 heads x 128 over Qwen3-8B's 3 x 4096 stacked hidden states;
            # 9.096B parameters on the meta device, the published 9.1B (fgrpo memory builds it)
            config=dict(
                num_layers=8,
                num_single_layers=24,
                attention_head_dim=128,
                num_attention_heads=32,
                joint_attention_dim=12288,
            ),
            source="reconstructed from the published sizes (9.096B parameters), not the file",
        )
        for name in ("black-forest-labs/FLUX.2-klein-9B", "black-forest-labs/FLUX.2-klein-base-9B")
    }

    @classmethod
    def forwards_per_sample(cls, keys: Mapping[str, Any]) -> int:
        """[klein] guides with true CFG (``guidance_scale`` > 1: two forwards)."""
        return guidance_forwards(keys.get("guidance_scale"))

    guidance_scale: float = param(
        4.0,
        ge=1.0,
        help="classifier-free guidance with negative_prompt (base models); 1 = off; step-distilled models ignore it",
    )
    text_encoder_out_layers: list[int] = param(
        factory=lambda: [9, 18, 27],
        validator=_layers,
        help="text-encoder hidden layers stacked into the prompt embedding",
    )

    @property
    def cfg_scale(self) -> float:
        if getattr(self._pipeline.config, "is_distilled", False):
            return 1.0
        return self.guidance_scale

    def _guidance(self, batch: int) -> None:
        return None  # klein has no guidance embedding: the pipeline passes guidance=None

    def from_pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """klein's ``output_type="latent"`` is the VAE's latent (denormalised, unpatchified): the
        inverse of :meth:`_vae_latents`."""
        patched = self._pipeline._patchify_latents(latents.float())
        mean, std = self._bn_stats(patched)
        return (patched - mean) / std


__all__ = ["FLUX2_LORA_TARGETS", "Flux2KleinPolicy", "Flux2Policy"]
