"""``flux``: FLUX.1 (diffusers ``FluxPipeline``) with a peft LoRA.

What differs from :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` (checked in tests
against ``pipe(..., output_type="latent")``):

- guidance: FLUX.1-dev is guidance-distilled: ``guidance_scale`` goes into the transformer's
  guidance embedding (one forward per call). True classifier-free guidance with the negative
  prompt is an option (``true_cfg_scale > 1``: NFE 2 per call), as in the pipeline;
- prompts: CLIP-L's pooled output (``pooled_prompt_embeds``) and T5's sequence (``prompt_embeds``,
  ``max_sequence_length`` tokens) from ``pipeline.encode_prompt``;
- the state is the unpacked latent (B, 16, H/8, W/8); the transformer sees 2x2 packed tokens
  (B, H/16 * W/16, 64). The image ids (one row per token) and text ids (zeros, one row per
  text token) have no batch dimension: they are computed from the shapes inside ``velocity``,
  never stored in ``cond``;
- ``timestep = sigma`` (the pipeline divides its 0-1000 timesteps by 1000);
- the schedule: ``linspace(1, 1/steps, steps)`` shifted by ``mu``, which grows with the number of
  image tokens (the resolution-dependent time shift), unless ``shift`` fixes it;
- LoRA r 64 / alpha 128 with gaussian init on attention and both feed-forward streams (flow_grpo's FLUX).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx
from fgrpo.models.diffusers_policy import DiffusersPolicy
from fgrpo.models.lora import JOINT_ATTENTION_LORA_TARGETS, lora_param
from fgrpo.models.sizes import Published, guidance_forwards

FLUX_LORA_TARGETS = (
    *JOINT_ATTENTION_LORA_TARGETS,
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


@attrs.define(eq=False)
class FluxPolicy(DiffusersPolicy):
    """FLUX.1-dev/schnell (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "FluxPipeline"
    published = {
        "black-forest-labs/FLUX.1-dev": Published(
            transformer=11.9e9,
            text=4.9e9,
            vae=0.08e9,
            hidden=3072,
            layers=57,
            config=dict(
                patch_size=1,
                in_channels=64,
                num_layers=19,
                num_single_layers=38,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=4096,
                pooled_projection_dim=768,
                guidance_embeds=True,
                axes_dims_rope=(16, 56, 56),
            ),
            source="black-forest-labs/FLUX.1-dev transformer/config.json",
        ),
        # Kontext [dev] is FLUX.1 [dev]'s transformer (12B) and text encoders, the source in sequence
        "black-forest-labs/FLUX.1-Kontext-dev": Published(
            transformer=11.9e9, text=4.9e9, vae=0.08e9, hidden=3072, layers=57, source="as FLUX.1-dev (12B)"
        ),
    }

    @classmethod
    def forwards_per_sample(cls, keys: Mapping[str, Any]) -> int:
        """One forward with the embedded guidance; two with true CFG (``true_cfg_scale`` > 1)."""
        return guidance_forwards(keys.get("true_cfg_scale"))

    text_encoder_names = ("text_encoder", "text_encoder_2")
    timestep_scale = 1.0
    explicit_sigma_grid = True
    packs_2x2 = True

    guidance_scale: float = param(
        3.5, ge=0.0, help="embedded guidance of guidance-distilled models (FLUX.1-dev); ignored by models without it"
    )
    true_cfg_scale: float = param(
        1.0, ge=1.0, help="true classifier-free guidance with negative_prompt; 1 = off, > 1: NFE 2 per call"
    )
    max_sequence_length: int = param(512, ge=1, le=512, help="T5 tokens per prompt")
    lora: dict | None = lora_param(64, FLUX_LORA_TARGETS, init="gaussian")

    _ids: dict = attrs.field(init=False, factory=dict, repr=False)

    @property
    def cfg_scale(self) -> float:
        return self.true_cfg_scale

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self._pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _non_batch_ids(self, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(text ids (L, 3), image ids (h/2 * w/2, 3)) as the pipeline makes them."""
        key = text_tokens
        if key not in self._ids:
            h, w = self._latent_shape[-2:]
            dtype = self.transformer.dtype
            image_ids = self._pipeline._prepare_latent_image_ids(1, h // 2, w // 2, self.device, dtype)
            text_ids = torch.zeros(text_tokens, 3, device=self.device, dtype=dtype)
            self._ids[key] = (text_ids, image_ids)
        return self._ids[key]

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        embeds = cond["prompt_embeds"]
        text_ids, image_ids = self._non_batch_ids(embeds.shape[1])
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((x.shape[0],), self.guidance_scale, device=self.device, dtype=torch.float32)
        return self._transformer_output(
            dx.pack_2x2(x),
            sigma,
            {"guidance": guidance, "txt_ids": text_ids, "img_ids": image_ids},
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=embeds,
        )


__all__ = ["FLUX_LORA_TARGETS", "FluxPolicy"]
