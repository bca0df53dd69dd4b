"""``z-image``: Z-Image and Z-Image-Turbo (diffusers ``ZImagePipeline``) with a peft LoRA.

What differs from :class:`~fgrpo.models.diffusers_policy.DiffusersPolicy` (checked in tests
against ``pipe(..., output_type="latent")``):

- prompts go through Qwen3's chat template (thinking enabled, as the pipeline does) into Qwen3;
  the second-to-last hidden state of the real tokens is the caption. The pipeline hands the
  transformer one caption of its own length per prompt; ``cond`` holds them zero-padded to
  ``max_sequence_length`` with ``prompt_embeds_mask``, and ``velocity`` cuts each row back to its
  own tokens;
- the transformer takes lists (one latent (C, 1, h, w) per sample), its timestep is ``1 - sigma``
  and it predicts ``x0 - eps``: ``velocity`` negates it, as the pipeline does;
- guidance: ``guidance_scale`` (5 for Z-Image; 0 for Z-Image-Turbo, which is distilled) as the
  pipeline applies it: ``pos + s (pos - neg)`` for ``s > 0`` (so 0 is off, NFE 2 otherwise), with
  the pipeline's options ``cfg_normalization`` (cap the guided norm at that multiple of the
  conditional one, per sample) and ``cfg_truncation`` (no guidance once ``1 - sigma`` exceeds
  it, per row);
- the schedule: ``linspace(1, 1/steps, steps)`` with the scheduler's shift (dynamic in the
  number of image tokens when its config says so);
- latents (B, 16, H/8, W/8) are the FLUX.1 VAE's normalised ones; 2x2 patches are tokens inside
  the transformer;
- LoRA r 64 / alpha 128 on Flow-Factory's default targets: attention and the SwiGLU feed-forward
  of every block (refiners included).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from fgrpo.core.config import param
from fgrpo.models.diffusers_policy import DiffusersPolicy
from fgrpo.models.lora import lora_param
from fgrpo.models.sizes import Published

#: Flow-Factory's default Z-Image targets (models/z_image/z_image.py ``default_target_modules``)
Z_IMAGE_LORA_TARGETS = (
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


@attrs.define(eq=False)
class ZImagePolicy(DiffusersPolicy):
    """Z-Image / Z-Image-Turbo (diffusers) with LoRA; satisfies :class:`fgrpo.core.protocols.Policy`."""

    pipeline_class_name = "ZImagePipeline"
    published = {
        "Tongyi-MAI/Z-Image": Published(transformer=6.15e9, text=4.0e9, vae=0.08e9, hidden=3840, layers=34),
        "Tongyi-MAI/Z-Image-Turbo": Published(transformer=6.15e9, text=4.0e9, vae=0.08e9, hidden=3840, layers=34),
    }

    @classmethod
    def forwards_per_sample(cls, keys: Mapping[str, Any]) -> int:
        """Z-Image's pipeline guides whenever ``guidance_scale`` > 0 (Turbo runs with 0: one forward)."""
        return 2 if float(keys.get("guidance_scale") or 0.0) > 0.0 else 1

    text_encoder_names = ("text_encoder",)
    timestep_scale = 1.0
    explicit_sigma_grid = True
    packs_2x2 = False  # the transformer patchifies the latent itself

    guidance_scale: float = param(
        5.0,
        ge=0.0,
        help="guidance as the pipeline applies it, pos + s (pos - neg); 0 = off (Z-Image-Turbo), > 0: NFE 2",
    )
    cfg_normalization: float = param(
        0.0, ge=0.0, help="cap the guided prediction's norm at this multiple of the conditional one; 0 = off"
    )
    cfg_truncation: float = param(
        1.0, ge=0.0, help="no guidance once 1 - sigma exceeds this (1: guidance at every step)"
    )
    max_sequence_length: int = param(512, ge=1, help="prompt tokens after the chat template (longer prompts are cut)")
    lora: dict | None = lora_param(64, Z_IMAGE_LORA_TARGETS)

    @property
    def cfg_scale(self) -> float:
        return self.guidance_scale

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 0.0

    def _encode_uncached(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        rows = self._pipeline._encode_prompt(
            list(prompts), device=device, max_sequence_length=self.max_sequence_length
        )
        width, dim = self.max_sequence_length, rows[0].shape[-1]
        embeds = rows[0].new_zeros(len(rows), width, dim)
        mask = torch.zeros(len(rows), width, dtype=torch.long, device=rows[0].device)
        for i, row in enumerate(rows):
            embeds[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def _predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        transformer = self.transformer
        dtype = transformer.dtype
        captions = [
            row[mask.bool()].to(dtype)
            for row, mask in zip(cond["prompt_embeds"], cond["prompt_embeds_mask"], strict=True)
        ]
        latents = list(x.to(dtype).unsqueeze(2).unbind(0))
        out = transformer(latents, 1.0 - sigma, captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if not self.cfg:
            return super().velocity(x, sigma, cond)
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        sigma = sigma.expand(b) if sigma.ndim == 0 else sigma.reshape(b)
        guided = super().velocity(x, sigma, cond)
        truncated = (1.0 - sigma) > self.cfg_truncation
        if bool(truncated.any()):  # those rows: the conditional prediction alone, as the pipeline runs them
            positive = {k: v for k, v in cond.items() if not k.startswith("negative_")}
            rows = truncated.nonzero().flatten()
            alone = self._predict(
                x[rows].to(self.device, torch.float32), sigma[rows], {k: v[rows] for k, v in positive.items()}
            )
            guided = guided.index_copy(0, rows, alone)
        return guided

    def _combine(self, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        # the pipeline's outputs are x0 - eps: here both are already negated, which the linear
        # combination and the norm cap commute with
        guided = cond + self.guidance_scale * (cond - uncond)
        if self.cfg_normalization > 0:
            dims = tuple(range(1, cond.dim()))
            limit = torch.linalg.vector_norm(cond, dim=dims, keepdim=True) * self.cfg_normalization
            norm = torch.linalg.vector_norm(guided, dim=dims, keepdim=True)
            guided = torch.where(norm > limit, guided * (limit / norm), guided)
        return guided

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2

    def _image_seq_len(self) -> int:
        h, w = self._latent_shape[-2:]
        return (h // 2) * (w // 2)

    def _default_size(self) -> tuple[int, int]:
        return 1024, 1024  # the pipeline's default


__all__ = ["ZImagePolicy", "Z_IMAGE_LORA_TARGETS"]
