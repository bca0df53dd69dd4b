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


@torch.no_grad()
def test_dancegrpo_and_mixgrpo_flux_schedule_and_timesteps():
    """DanceGRPO and MixGRPO drive FLUX over sd3_time_shift(3, linspace(1, 0, N + 1)) and give the
    transformer int(sigma * 1000) / 1000 (DanceGRPO train_grpo_flux.py:230-238, 311-313; MixGRPO
    sampling_utils.py:64-71): model.shift 3 and integer_timesteps true. By default the flux
    backbone shifts by resolution (flow_grpo's and the pipeline's mu) and passes sigma itself."""
    from fgrpo.models.flux import FluxPolicy

    policy = FluxPolicy.from_pipeline(
        build_tiny_flux_pipeline(),
        device="cpu",
        resolution=64,
        max_sequence_length=SEQ,
        shift=3.0,
        integer_timesteps=True,
    )
    sigma_schedule = torch.linspace(1, 0, 17)
    sigma_schedule = (3.0 * sigma_schedule) / (1 + 2.0 * sigma_schedule)
    sigmas = policy.sigmas(16)
    torch.testing.assert_close(sigmas, sigma_schedule, rtol=0, atol=1e-7)
    seen = []
    policy.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["timestep"].clone()), with_kwargs=True
    )
    cond = policy.encode(["a cat"])
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    for i in range(16):
        policy.velocity(x, sigmas[i].expand(1), cond)
    expected = torch.tensor([int(s * 1000) for s in sigma_schedule[:16]]) / 1000
    torch.testing.assert_close(torch.cat(seen), expected.float(), rtol=0, atol=0)
    default = FluxPolicy.from_pipeline(
        build_tiny_flux_pipeline(), device="cpu", resolution=64, max_sequence_length=SEQ
    )
    assert not default._integer_timesteps and not torch.allclose(default.sigmas(16), sigmas)
