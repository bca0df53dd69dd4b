"""``sd3``: Stable Diffusion 3 / 3.5 (diffusers ``StableDiffusion3Pipeline``) with a peft LoRA.

What differs from :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` (checked in tests
against ``pipe(..., output_type="latent")``):

- prompts: CLIP-L, CLIP-G and T5 through ``pipeline.encode_prompt``: ``prompt_embeds``
  (B, 77 + max_sequence_length, 4096) and ``pooled_prompt_embeds`` (B, 2048);
- the transformer is called with ``timestep = sigma * 1000``; classifier-free guidance
  (``guidance_scale > 1``) with the negative prompt (empty by default), as the pipeline does;
- latents (B, 16, H/8, W/8) are the VAE's normalised ``(z - shift_factor) * scaling_factor``;
- LoRA on both attention streams of every joint block (not SD3.5's attn2), r 32 / alpha 64, gaussian
  init (flow_grpo's SD3.5).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.models.diffusers_policy import DiffusersPolicy
from fgrpo.models.lora import JOINT_ATTENTION_LORA_TARGETS, lora_param
from fgrpo.models.sizes import Geometry, Published

#: LoRA on both attention streams of every joint block (image: attn.to_*; text: attn.add_*/to_add_out),
#: not SD3.5's dual attention attn2, as flow_grpo does for SD3.5 (r 32, alpha 64, gaussian init).
SD3_LORA_TARGETS = JOINT_ATTENTION_LORA_TARGETS


@attrs.define(eq=False)
class SD3Policy(DiffusersPolicy):
    """SD3/SD3.5 (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "StableDiffusion3Pipeline"
    geometry = Geometry(extra_text_tokens=77)  # CLIP's 77 tokens beside T5's
    published = {
        "stabilityai/stable-diffusion-3.5-medium": Published(
            transformer=2.5e9,
            text=5.6e9,
            vae=0.08e9,
            hidden=1536,
            layers=24,
            config=dict(
                sample_size=128,
                patch_size=2,
                in_channels=16,
                num_layers=24,
                attention_head_dim=64,
                num_attention_heads=24,
                joint_attention_dim=4096,
                caption_projection_dim=1536,
                pooled_projection_dim=2048,
                out_channels=16,
                pos_embed_max_size=384,
                dual_attention_layers=tuple(range(13)),
                qk_norm="rms_norm",
            ),
            source="stabilityai/stable-diffusion-3.5-medium transformer/config.json",
        )
    }
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    timestep_scale = 1000.0

    guidance_scale: float = param(
        1.0, ge=1.0, help="classifier-free guidance scale; 1 = off, > 1 doubles the forward (NFE 2 per call)"
    )
    max_sequence_length: int = param(256, ge=1, le=512, help="T5 tokens per prompt")
    lora: dict | None = lora_param(32, SD3_LORA_TARGETS, init="gaussian")

    @property
    def cfg_scale(self) -> float:
        return self.guidance_scale

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self._pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._transformer_output(
            x, sigma, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled_prompt_embeds"]
        )

    def _default_size(self) -> tuple[int, int]:
        side = int(self.transformer.config.sample_size) * self.vae_scale_factor
        return side, side


__all__ = ["SD3Policy", "SD3_LORA_TARGETS"]
