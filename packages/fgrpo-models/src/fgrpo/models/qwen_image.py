"""``qwen-image``: Qwen-Image (diffusers ``QwenImagePipeline``) with a peft LoRA.

What differs from :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` (checked in tests
against ``pipe(..., output_type="latent")``):

- prompts go through the pipeline's prompt template into Qwen2.5-VL; the template's first
  ``prompt_template_encode_start_idx`` tokens are dropped, as the pipeline does. ``cond`` holds
  ``prompt_embeds`` padded to ``max_sequence_length`` tokens and ``prompt_embeds_mask`` (1 for
  real tokens), so every prompt has the same width; ``velocity`` trims both to the longest
  prompt of its batch (the pipeline's padding) and drops an all-ones mask, as the pipeline does
  (``text_padding_mask: false`` never masks: flow_grpo's diffusers ignored the mask);
- true classifier-free guidance (``true_cfg_scale``, 4 by default) with the negative prompt
  (" " by default), then the pipeline's rescale of the guided prediction to the norm of the
  conditional one (per token);
- the state is the unpacked latent (B, 16, H/8, W/8) (the pipeline's frame axis of length 1
  dropped); the transformer sees 2x2 packed tokens; the image shapes it needs for its rotary
  embedding have no batch dimension and are derived from the state's shape;
- ``timestep = sigma``; the schedule is the pipeline's: ``linspace(1, 1/steps, steps)`` with the
  resolution-dependent exponential shift and the terminal stretch of its scheduler;
- latents are normalised per channel by the VAE's ``latents_mean``/``latents_std``.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.models import _diffusers as dx
from fgrpo.models.diffusers_policy import DiffusersPolicy
from fgrpo.models.lora import JOINT_ATTENTION_LORA_TARGETS, lora_param
from fgrpo.models.sizes import Published

QWEN_IMAGE_LORA_TARGETS = (
    *JOINT_ATTENTION_LORA_TARGETS,
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)


@attrs.define(eq=False)
class QwenImagePolicy(DiffusersPolicy):
    """Qwen-Image (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "QwenImagePipeline"
    published = {
        "Qwen/Qwen-Image": Published(
            transformer=20.4e9,
            text=8.3e9,
            vae=0.13e9,
            hidden=3072,
            layers=60,
            config=dict(
                patch_size=2,
                in_channels=64,
                out_channels=16,
                num_layers=60,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=3584,
                guidance_embeds=False,
                axes_dims_rope=(16, 56, 56),
            ),
            source="Qwen/Qwen-Image transformer/config.json",
        ),
        # the editing models keep Qwen-Image's transformer and Qwen2.5-VL encoder
        "Qwen/Qwen-Image-Edit": Published(transformer=20.4e9, text=8.3e9, vae=0.13e9, hidden=3072, layers=60),
        "Qwen/Qwen-Image-Edit-2509": Published(transformer=20.4e9, text=8.3e9, vae=0.13e9, hidden=3072, layers=60),
    }
    text_encoder_names = ("text_encoder",)
    timestep_scale = 1.0
    explicit_sigma_grid = True
    packs_2x2 = True

    true_cfg_scale: float = param(
        4.0, ge=1.0, help="classifier-free guidance with negative_prompt (rescaled to the conditional norm); 1 = off"
    )
    negative_prompt: str = param(" ", help="the unconditional prompt of classifier-free guidance")
    max_sequence_length: int = param(
        512, ge=1, le=1024, help="prompt tokens after the template (longer prompts are cut)"
    )
    text_padding_mask: bool = param(
        True,
        help="mask the padding of shorter prompts in joint attention (diffusers >= 0.36); false: attend to it, as "
        "flow_grpo's diffusers did (it ignored the mask, diffusers#12294): a sample's velocity then depends on "
        "the other prompts of its forward batch",
    )
    lora: dict | None = lora_param(64, QWEN_IMAGE_LORA_TARGETS, init="gaussian")

    @property
    def cfg_scale(self) -> float:
        return self.true_cfg_scale

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, mask = self._pipeline._get_qwen_prompt_embeds(prompts, device)
        width = self.max_sequence_length
        embeds, mask = embeds[:, :width], mask[:, :width]
        pad = width - embeds.shape[1]
        if pad:
            embeds = torch.cat([embeds, embeds.new_zeros(embeds.shape[0], pad, embeds.shape[2])], dim=1)
            mask = torch.cat([mask, mask.new_zeros(mask.shape[0], pad)], dim=1)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        mask = cond["prompt_embeds_mask"]
        longest = int(mask.sum(dim=1).max())
        embeds, mask = cond["prompt_embeds"][:, :longest], mask[:, :longest]
        h, w = self._latent_shape[-2:]
        masked = self.text_padding_mask and not bool(mask.all())
        as_given = {
            "encoder_hidden_states_mask": mask if masked else None,
            "img_shapes": [[(1, h // 2, w // 2)]] * x.shape[0],
        }
        return self._transformer_output(dx.pack_2x2(x), sigma, as_given, encoder_hidden_states=embeds)

    def _combine(self, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        guided = dx.guided(uncond, cond, self.cfg_scale)
        return guided * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True))

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self._pipeline.vae
        z = latents.to(vae.dtype)[:, :, None]  # the VAE's frame axis
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        image = vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


__all__ = ["QWEN_IMAGE_LORA_TARGETS", "QwenImagePolicy"]
