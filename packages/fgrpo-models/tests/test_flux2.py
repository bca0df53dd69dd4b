"""The flux2 and flux2-klein backbones on tiny random Flux2Pipeline / Flux2KleinPipeline (FLUX.2
[dev] and [klein]'s structure), saved and loaded offline."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.models.flux2 import FLUX2_LORA_TARGETS
from fgrpo.models.testing import (
    DiffusersBackboneConformance,
    build_tiny_flux2_klein_pipeline,
    build_tiny_flux2_pipeline,
)
from fgrpo.models.testing.conformance import assert_matches

SEQ = 48
LAYERS = [1, 2, 2]  # the tiny text encoders have 2 layers; the real defaults stack (10, 20, 30) / (9, 18, 27)


class TestFlux2(DiffusersBackboneConformance):
    model_name = "flux2"
    build_pipeline = staticmethod(build_tiny_flux2_pipeline)
    model_params = {
        "max_sequence_length": SEQ,
        "guidance_scale": 4.0,
        "resolution": 64,
        "text_encoder_out_layers": LAYERS,
    }
    guidance_key = "guidance_scale"  # embedded: "guidance" changes the velocity, not the NFE
    reward = {"name": "jpeg-compressibility"}

    def pipeline_kwargs(self, policy):
        return {"height": 64, "width": 64, "max_sequence_length": SEQ, "text_encoder_out_layers": tuple(LAYERS)}

    @pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
    @torch.no_grad()
    def test_euler_loop_reproduces_the_pipeline(self, model_keys, guided):
        """FLUX.2 [dev] has no negative branch: 'guidance' is the embedded scale (1 and 4.5)."""
        torch.manual_seed(0)
        policy = self.make_policy(
            {**model_keys, "lora": {**self.lora, "init": "random"}, "guidance_scale": 4.5 if guided else 1.0}
        )
        assert policy.evaluations_per_call == 1
        x = policy.initial_noise(2, torch.Generator().manual_seed(3))
        start, sigmas, cond = x.clone(), policy.sigmas(self.steps), self.cond(policy)
        for i in range(self.steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigmas[i].expand(len(x)), cond)
        check = "euler loop vs pipeline, " + ("guidance" if guided else "no guidance")
        assert_matches(
            self.label or self.model_name,
            check,
            x,
            self.run_pipeline(policy, policy.pipeline, start).float(),
            self.pipeline_atol,
        )

    def test_prompt_cache_encodes_each_prompt_once(self, model_keys):
        policy = self.make_policy(model_keys, prompt_cache_size=2)
        a, b = self.prompts[:2]
        policy.encode([a, b, a])
        assert policy.prompt_cache.encoded == 2  # no negative prompt: guidance is embedded
        policy.encode(["something new"])
        assert policy.prompt_cache.encoded == 3 and len(policy.prompt_cache) == 2

    def test_layout_and_schedule(self, policy):
        assert policy.latent_shape == (128, 4, 4)  # 32 VAE channels patchified 2x2, at H/16
        assert policy.lora["target_modules"] == list(FLUX2_LORA_TARGETS)
        assert set(policy.encode(["a"])) == {"prompt_embeds"}  # position ids are derived, not batched
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        # FLUX.2's shift depends on the number of steps too: the pipeline's own scheduler gives these sigmas
        for steps in (4, 28):
            scheduler = type(policy.pipeline.scheduler).from_config(policy.pipeline.scheduler.config)
            import numpy as np

            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(16, steps))
            torch.testing.assert_close(policy.sigmas(steps), scheduler.sigmas.float(), rtol=0, atol=1e-6)


class TestFlux2Klein(DiffusersBackboneConformance):
    model_name = "flux2-klein"
    build_pipeline = staticmethod(build_tiny_flux2_klein_pipeline)
    model_params = {
        "max_sequence_length": SEQ,
        "guidance_scale": 1.0,
        "resolution": 64,
        "text_encoder_out_layers": LAYERS,
    }
    guidance_key = "guidance_scale"
    pipeline_takes_negative_prompt = False  # the pipeline's negative prompt is always ""
    reward = {"name": "jpeg-compressibility"}

    def pipeline_kwargs(self, policy):
        return {"height": 64, "width": 64, "max_sequence_length": SEQ, "text_encoder_out_layers": tuple(LAYERS)}

    def test_distilled_klein_ignores_guidance(self, tmp_path):
        build_tiny_flux2_klein_pipeline(tmp_path / "distilled", is_distilled=True)
        policy = self.make_policy(
            {"path": str(tmp_path / "distilled"), "device": "cpu", "lora": {"rank": 2}, **self.model_params},
            guidance_scale=4.0,
        )
        assert policy.cfg_scale == 1.0 and policy.evaluations_per_call == 1
