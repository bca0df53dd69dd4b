"""The flux backbone on a tiny random FluxPipeline (FLUX.1-dev's structure), saved and loaded offline."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.models import _diffusers as dx
from fgrpo.models.flux import FLUX_LORA_TARGETS
from fgrpo.models.testing import DiffusersBackboneConformance, build_tiny_flux_pipeline

SEQ = 16


class TestFlux(DiffusersBackboneConformance):
    model_name = "flux"
    build_pipeline = staticmethod(build_tiny_flux_pipeline)
    model_params = {"max_sequence_length": SEQ, "guidance_scale": 3.5, "resolution": 64}
    guidance_key = "true_cfg_scale"
    reward = {"name": "jpeg-compressibility"}

    def pipeline_kwargs(self, policy):
        return {"height": 64, "width": 64, "max_sequence_length": SEQ, "guidance_scale": policy.guidance_scale}

    def test_defaults(self, policy):
        assert policy.latent_shape == (16, 8, 8)
        assert policy.lora["target_modules"] == list(FLUX_LORA_TARGETS)
        assert set(policy.encode(["a"])) == {"prompt_embeds", "pooled_prompt_embeds"}  # no ids: they are not batched

    @torch.no_grad()
    def test_guidance_embedding_is_used_without_extra_forwards(self, policy, model_keys):
        x, sigma = self.state(policy)
        cond = self.cond(policy)
        other = self.make_policy(model_keys, guidance_scale=1.0)
        other.load_trainable_state_dict(policy.trainable_state_dict())
        assert policy.evaluations_per_call == other.evaluations_per_call == 1
        assert not torch.allclose(policy.velocity(x, sigma, cond), other.velocity(x, sigma, cond))

    def test_time_shift_depends_on_resolution(self, model_keys):
        small = self.make_policy(model_keys, resolution=32).sigmas(8)
        large = self.make_policy(model_keys, resolution=128).sigmas(8)
        assert torch.all(large[1:-1] > small[1:-1])  # more image tokens, more time at high noise
        fixed = self.make_policy(model_keys, resolution=128, shift=3.0).sigmas(8)
        t = torch.linspace(1, 1 / 8, 8, dtype=torch.float64)
        torch.testing.assert_close(fixed[:-1], (3 * t / (1 + 2 * t)).float())


def test_packing_is_the_pipelines():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 8, 6)
    packed = FluxPipeline._pack_latents(x, 2, 16, 8, 6)
    assert torch.equal(dx.pack_2x2(x), packed)
    assert torch.equal(dx.unpack_2x2(packed, 8, 6), x)
