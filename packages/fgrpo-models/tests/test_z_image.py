"""The z-image backbone on a tiny random ZImagePipeline (Z-Image / Z-Image-Turbo), saved and loaded offline."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.models.testing import DiffusersBackboneConformance, build_tiny_z_image_pipeline
from fgrpo.models.testing.conformance import assert_matches

SEQ = 48


class TestZImage(DiffusersBackboneConformance):
    model_name = "z-image"
    build_pipeline = staticmethod(build_tiny_z_image_pipeline)
    model_params = {"max_sequence_length": SEQ, "guidance_scale": 0.0, "resolution": 64}  # Turbo: no guidance
    prompts = ("a red circle to the left of a cat", "hi")  # captions of different lengths
    guidance_key = "guidance_scale"
    reward = {"name": "jpeg-compressibility"}

    def pipeline_kwargs(self, policy):
        return {"height": 64, "width": 64, "max_sequence_length": SEQ}

    @torch.no_grad()
    def test_guidance_options_are_the_pipelines(self, model_keys):
        """cfg_normalization caps the guided norm per sample; cfg_truncation drops guidance at the
        low-noise steps (per row): the Euler loop still equals the pipeline's output."""
        policy = self.make_policy(
            {**model_keys, "lora": {**self.lora, "init": "random"}},
            guidance_scale=4.0,
            cfg_normalization=1.0,
            cfg_truncation=0.2,
        )
        x = policy.initial_noise(2, torch.Generator().manual_seed(3))
        start, steps = x.clone(), 4
        sigmas, cond = policy.sigmas(steps), self.cond(policy)
        assert bool((1 - sigmas[:-1] > 0.2).any()) and bool((1 - sigmas[:-1] <= 0.2).any())  # both kinds of step
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigmas[i].expand(len(x)), cond)
        reference = policy.pipeline(
            prompt=list(self.prompts),
            latents=start.clone(),
            num_inference_steps=steps,
            output_type="latent",
            guidance_scale=4.0,
            cfg_normalization=1.0,
            cfg_truncation=0.2,
            negative_prompt=["", ""],
            **self.pipeline_kwargs(policy),
        )[0]
        assert_matches(
            self.label or self.model_name,
            "euler loop vs pipeline, cfg_normalization + cfg_truncation",
            x,
            reference.float(),
            self.pipeline_atol,
        )
        mixed = torch.stack([sigmas[0], sigmas[-2]])  # a batch with a guided and a truncated row
        both = policy.velocity(start, mixed, cond)
        for row in range(2):
            alone = policy.velocity(
                start[row : row + 1], mixed[row : row + 1], {k: v[row : row + 1] for k, v in cond.items()}
            )
            torch.testing.assert_close(both[row : row + 1], alone, rtol=0, atol=1e-5)

    def test_captions_keep_their_own_length(self, policy):
        cond = policy.encode(list(self.prompts))
        lengths = cond["prompt_embeds_mask"].sum(dim=1)
        assert cond["prompt_embeds"].shape[:2] == (2, SEQ) and lengths[0] > lengths[1]
        rows = policy.pipeline._encode_prompt(list(self.prompts), device=policy.device, max_sequence_length=SEQ)
        for i, row in enumerate(rows):
            torch.testing.assert_close(cond["prompt_embeds"][i, : len(row)], row, rtol=0, atol=1e-6)
            assert int(lengths[i]) == len(row) and torch.all(cond["prompt_embeds"][i, len(row) :] == 0)
