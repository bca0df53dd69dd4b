"""``wan``: Wan 2.1 text-to-video (diffusers ``WanPipeline``) with a peft LoRA.

What differs from :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` (checked in tests
against ``pipe(..., output_type="latent")``):

- outputs are videos: ``decode`` returns frame stacks (B, T, 3, H, W) in [0, 1]
  (``num_frames`` = 4k + 1); rewards receive them (an image reward scores every k-th frame
  through the reward's ``frame_stride`` key, see fgrpo.core.phases.score);
- the state is the video latent (B, 16, (T - 1)/4 + 1, H/8, W/8), normalised per channel by
  the VAE's ``latents_mean``/``latents_std``;
- prompts: UMT5 through ``pipeline.encode_prompt``, zero-padded to ``max_sequence_length``;
- ``timestep = sigma * 1000``; classifier-free guidance (``guidance_scale``, 5 by default) with
  the negative prompt, as the pipeline does;
- the schedule: the scheduler's flow-shifted sigmas. Wan 2.1 ships a UniPC multistep
  scheduler; fgrpo integrates the same sigmas one (Euler or stochastic) step at a time;
- Wan 2.2's two-expert pipelines (``transformer_2``) and per-token timesteps are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.models.diffusers_policy import DiffusersPolicy
from fgrpo.models.lora import lora_param

#: self- and cross-attention and the feed-forward of every block
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")


def _frames(_inst: Any, _attribute: Any, value: Any) -> None:
    if isinstance(value, int) and (value - 1) % 4:
        raise ValueError(f"got {value!r}; allowed: 4k + 1 frames (1, 5, 9, ..., 81)")


@attrs.define(eq=False)
class WanPolicy(DiffusersPolicy):
    """Wan 2.1 text-to-video (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "WanPipeline"
    text_encoder_names = ("text_encoder",)
    timestep_scale = 1000.0

    guidance_scale: float = param(5.0, ge=1.0, help="classifier-free guidance scale; 1 = off, > 1: NFE 2 per call")
    num_frames: int = param(81, ge=1, validator=_frames, help="frames per video (4k + 1)")
    max_sequence_length: int = param(512, ge=1, help="UMT5 tokens per prompt (zero-padded)")
    decode_batch_size: int = param(1, ge=0, help="videos per VAE decode call; 0: the whole batch at once")
    lora: dict | None = lora_param(32, WAN_LORA_TARGETS)

    @property
    def cfg_scale(self) -> float:
        return self.guidance_scale

    def _check_pipeline(self, pipe: Any) -> None:
        if getattr(pipe, "transformer_2", None) is not None or getattr(pipe.config, "expand_timesteps", False):
            raise ValueError(
                "model.path: a Wan 2.2 pipeline (two experts or per-token timesteps); the wan backbone drives Wan 2.1 "
                "text-to-video pipelines"
            )

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, _ = self._pipeline.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length, device=device,
        )
        return {"prompt_embeds": embeds}

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._transformer_output(x, sigma, encoder_hidden_states=cond["prompt_embeds"])

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self._pipeline.vae
        z = latents.to(vae.dtype)
        channels = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # (B, 3, T, H, W) in [-1, 1]
        return (video.float().permute(0, 2, 1, 3, 4) / 2 + 0.5).clamp(0, 1)

    @property
    def vae_scale_factor(self) -> int:
        return int(self._pipeline.vae_scale_factor_spatial)

    def _latent_shape_for(self, height: int, width: int) -> tuple[int, int, int, int]:
        scale = self.vae_scale_factor
        temporal = int(self._pipeline.vae_scale_factor_temporal)
        return (int(self.transformer.config.in_channels), (self.num_frames - 1) // temporal + 1, height // scale, width // scale)

    def _default_size(self) -> tuple[int, int]:
        return 480, 832  # the pipeline's defaults

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * int(self.transformer.config.patch_size[-1])

    def _image_seq_len(self) -> int:
        t, h, w = self._latent_shape[-3:]
        p = self.transformer.config.patch_size
        return (t // p[0]) * (h // p[1]) * (w // p[2])


__all__ = ["WAN_LORA_TARGETS", "WanPolicy"]
