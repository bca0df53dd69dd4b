"""The wan backbone on a tiny random WanPipeline (Wan 2.1 text-to-video), saved and loaded offline."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.models.testing import DiffusersBackboneConformance, build_tiny_wan_pipeline

SEQ = 16


class TestWan(DiffusersBackboneConformance):
    model_name = "wan"
    build_pipeline = staticmethod(build_tiny_wan_pipeline)
    model_params = {"max_sequence_length": SEQ, "resolution": 32, "num_frames": 5, "guidance_scale": 1.0}
    guidance_key = "guidance_scale"
    reward = {"name": "jpeg-compressibility", "frame_stride": 2}  # an image reward on every 2nd frame

    def pipeline_kwargs(self, policy):
        return {"height": 32, "width": 32, "num_frames": 5, "max_sequence_length": SEQ}

    @torch.no_grad()
    def test_outputs_are_frame_stacks(self, policy):
        assert policy.latent_shape == (16, 2, 4, 4)
        video = policy.decode(policy.initial_noise(2))
        assert video.shape == (2, 5, 3, 32, 32)

    def test_multistep_flow_scheduler_gives_its_sigmas(self, policy):
        from diffusers import UniPCMultistepScheduler

        unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
        unipc.set_timesteps(6)
        from fgrpo.models import _diffusers as dx

        ours = dx.scheduler_sigmas(unipc, 6, shift=None, device=torch.device("cpu"))
        torch.testing.assert_close(ours, unipc.sigmas.float(), rtol=0, atol=1e-5)

    def test_frames_must_be_4k_plus_1(self, model_keys):
        from fgrpo.core.config import check_params
        from fgrpo.models.wan import WanPolicy

        _, errors = check_params(WanPolicy, {"path": "x", "num_frames": 6})
        assert [e.key for e in errors] == ["num_frames"] and "4k + 1" in str(errors[0])
