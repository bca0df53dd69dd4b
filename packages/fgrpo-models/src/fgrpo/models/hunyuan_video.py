"""``hunyuan-video-1.5``: HunyuanVideo 1.5 text-to-video (diffusers ``HunyuanVideo15Pipeline``) with a
peft LoRA.

What differs from :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` (checked in tests
against ``pipe(..., output_type="latent")``):

- outputs are videos (B, T, 3, H, W) in [0, 1]; the state is the VAE latent (B, 32, (T - 1)/4 + 1,
  H/16, W/16), scaled by the VAE's ``scaling_factor``. The transformer sees ``[state, zeros,
  zero mask]`` (65 channels: image-to-video's condition slots, empty for text-to-video) and
  all-zero image embeddings (which mark the call as text-to-video); both are derived inside
  ``velocity``, never stored;
- prompts: Qwen2.5-VL on the pipeline's chat template (its first 108 tokens cropped, the third-
  to-last hidden state), ``max_sequence_length`` tokens with a mask, plus ByT5 embeddings of
  quoted text (glyphs, ``glyph_sequence_length`` tokens, all masked when a prompt quotes
  nothing), as ``pipeline.encode_prompt`` makes them;
- ``timestep = sigma * 1000``; guidance is the pipeline's guider (``ClassifierFreeGuidance``):
  ``guidance_scale``, ``guidance_rescale`` and ``use_original_formulation`` default to its
  config, with the negative prompt; a guider that skips guidance on some steps (``start``/``stop``)
  is refused (a velocity call knows its noise level, not its step number);
- the schedule: ``linspace(1, 0, steps + 1)[:-1]`` shifted by the scheduler's shift;
- LoRA r 32 / alpha 64 on the image and text streams' attention and feed-forwards of every
  double-stream block.
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
from fgrpo.models.sizes import Geometry, Published
from fgrpo.models.wan import _frames

#: attention (both streams) and the feed-forwards of every double-stream block
HUNYUAN_VIDEO15_LORA_TARGETS = (
    *JOINT_ATTENTION_LORA_TARGETS,
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


@attrs.define(eq=False)
class HunyuanVideo15Policy(DiffusersPolicy):
    """HunyuanVideo 1.5 text-to-video (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "HunyuanVideo15Pipeline"
    geometry = Geometry(temporal=4, extra_text_tokens=256, values_per_token=32)  # ByT5's 256 glyph tokens
    published = {
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v": Published(
            transformer=8.3e9, text=8.5e9, vae=0.5e9, hidden=2048, layers=54
        )
    }
    text_encoder_names = ("text_encoder", "text_encoder_2")
    timestep_scale = 1000.0
    explicit_sigma_grid = True  # linspace(1, 0, steps + 1)[:-1] is linspace(1, 1/steps, steps)

    guidance_scale: float | None = param(
        None, ge=0.0, help="classifier-free guidance scale; null: the pipeline guider's"
    )
    guidance_rescale: float | None = param(
        None, ge=0.0, le=1.0, help="rescale of the guided prediction to the conditional std; null: the guider's"
    )
    num_frames: int = param(121, ge=1, validator=_frames, help="frames per video (4k + 1)")
    max_sequence_length: int = param(
        1000, ge=1, help="Qwen2.5-VL tokens per prompt after the template (the pipeline's tokenizer_max_length)"
    )
    glyph_sequence_length: int = param(
        256, ge=1, help="ByT5 tokens of a prompt's quoted text (the pipeline's tokenizer_2_max_length)"
    )
    decode_batch_size: int = param(
        1,
        ge=1,
        le=1,
        help="videos per VAE decode call: 1 (diffusers 0.42's HunyuanVideo 1.5 VAE fails on batches of videos: its "
        "causal attention mask)",
    )
    lora: dict | None = lora_param(32, HUNYUAN_VIDEO15_LORA_TARGETS)

    def _check_pipeline(self, pipe: Any) -> None:
        guider = pipe.guider
        if float(getattr(guider, "_start", 0.0)) != 0.0 or float(getattr(guider, "_stop", 1.0)) != 1.0:
            raise ValueError(
                "model.path: the pipeline's guider guides only steps start..stop; fgrpo's velocity knows the noise "
                "level, "
                "not the step: use a guider with start 0 and stop 1"
            )
        if self.guidance_scale is None:
            self.guidance_scale = float(guider.guidance_scale)
        if self.guidance_rescale is None:
            self.guidance_rescale = float(guider.guidance_rescale)
        # the text widths are pipeline attributes its encode_prompt reads
        pipe.tokenizer_max_length = self.max_sequence_length
        pipe.tokenizer_2_max_length = self.glyph_sequence_length

    @property
    def _original_formulation(self) -> bool:
        return bool(getattr(self._pipeline.guider, "use_original_formulation", False))

    @property
    def cfg_scale(self) -> float:
        assert self.guidance_scale is not None  # resolved from the guider by __attrs_post_init__
        return float(self.guidance_scale)

    @property
    def cfg(self) -> bool:
        import math

        return not math.isclose(self.cfg_scale, 0.0 if self._original_formulation else 1.0)  # the guider's rule

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        embeds, mask, glyphs, glyph_mask = self._pipeline.encode_prompt(
            prompt=prompts, device=device, dtype=torch.float32, batch_size=len(prompts)
        )
        return {
            "prompt_embeds": embeds,
            "prompt_embeds_mask": mask,
            "prompt_embeds_2": glyphs,
            "prompt_embeds_mask_2": glyph_mask,
        }

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        transformer = self.transformer
        dtype = transformer.dtype
        b, _, frames, h, w = x.shape
        empty = x.new_zeros(b, x.shape[1] + 1, frames, h, w)  # image-to-video's condition latents and mask
        image_embeds = torch.zeros(
            b,
            self._pipeline.vision_num_semantic_tokens,
            transformer.config.image_embed_dim,
            device=self.device,
            dtype=dtype,
        )
        return self._forward(
            hidden_states=torch.cat([x, empty], dim=1).to(dtype),
            image_embeds=image_embeds,
            timestep=self._timestep(sigma).to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            encoder_attention_mask=cond["prompt_embeds_mask"].to(dtype),
            encoder_hidden_states_2=cond["prompt_embeds_2"].to(dtype),
            encoder_attention_mask_2=cond["prompt_embeds_mask_2"].to(dtype),
            return_dict=False,
        )[0].float()

    def _combine(self, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        from diffusers.guiders.guider_utils import rescale_noise_cfg

        base = cond if self._original_formulation else uncond
        guided = base + self.cfg_scale * (cond - uncond)
        assert self.guidance_rescale is not None  # resolved from the guider by __attrs_post_init__
        if self.guidance_rescale > 0.0:
            guided = rescale_noise_cfg(guided, cond, self.guidance_rescale)
        return guided

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self._pipeline.vae
        return dx.video_frames(vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0])

    @property
    def vae_scale_factor(self) -> int:
        return int(self._pipeline.vae_scale_factor_spatial)

    def _latent_shape_for(self, height: int, width: int) -> tuple[int, int, int, int]:
        return dx.video_latent_shape(
            self._pipeline, self._pipeline.vae.config.latent_channels, self.num_frames, height, width
        )

    def _default_size(self) -> tuple[int, int]:
        pipe = self._pipeline
        ratio = pipe.default_aspect_ratio
        height, width = pipe.video_processor.calculate_default_height_width(ratio[1], ratio[0], pipe.target_size)
        return int(height), int(width)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * int(self.transformer.config.patch_size)


__all__ = ["HUNYUAN_VIDEO15_LORA_TARGETS", "HunyuanVideo15Policy"]
