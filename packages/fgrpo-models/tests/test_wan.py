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

    def test_multistep_flow_scheduler_gives_its_sigmas_and_timesteps(self):
        from fgrpo.models import _diffusers as dx

        unipc = unipc_scheduler()
        for steps in (1, 6, 20):
            unipc.set_timesteps(steps)
            sigmas, timesteps = dx.scheduler_grid(unipc, steps, shift=None)
            assert torch.equal(sigmas, unipc.sigmas.float()) and torch.equal(timesteps, unipc.timesteps)
        euler_sigmas, euler_timesteps = dx.scheduler_grid(build_tiny_wan_pipeline().scheduler, 6, shift=None)
        assert euler_timesteps is None  # Euler hands sigma * 1000 over as a float


def unipc_scheduler(shift: float = 3.0):
    """Wan 2.1's released scheduler (Wan-AI/Wan2.1-T2V-1.3B-Diffusers: UniPC over flow sigmas)."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)


def unipc_policy(**keys):
    from fgrpo.models.wan import WanPolicy

    pipe = build_tiny_wan_pipeline()
    pipe.scheduler = unipc_scheduler()
    base = {"device": "cpu", "max_sequence_length": SEQ, "resolution": 32, "num_frames": 5, "guidance_scale": 1.0}
    return WanPolicy.from_pipeline(pipe, **{**base, **keys})


@torch.no_grad()
def test_velocity_sees_the_integer_timesteps_unipc_hands_the_transformer():
    """WanPipeline passes UniPC's int64 timesteps (truncated sigma * 1000) to the transformer; so
    does the policy by default with that scheduler (integer_timesteps: null), on every grid it made."""
    policy = unipc_policy()
    exact = unipc_policy(integer_timesteps=False)
    exact.load_trainable_state_dict(policy.trainable_state_dict())
    pipe = policy.pipeline
    cond = policy.encode(["a red ball", "text"])
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    for steps in (20, 7):
        sigmas = policy.sigmas(steps)
        pipe.scheduler.set_timesteps(steps)
        for i in (0, steps // 2, steps - 1):
            t = pipe.scheduler.timesteps[i]
            expected = pipe.transformer(
                hidden_states=x, timestep=t.expand(2), encoder_hidden_states=cond["prompt_embeds"], return_dict=False
            )[0].float()
            got = policy.velocity(x, sigmas[i].expand(2), cond)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
            assert float(t) != float(sigmas[i]) * 1000  # truncated: 999 at sigma 0.999999 ...
            assert not torch.equal(exact.velocity(x, sigmas[i].expand(2), cond), got)


def test_diffusers_0_33_grid_is_flow_grpos():
    """flow_grpo pins diffusers 0.33.1, whose UniPC flow grid is 1 - linspace(1, 1/T, N + 1) reversed
    and shifted: up to 0.0025 from the installed one at 20 steps, shift 3 (at the last step), and
    other integer timesteps (963 against 964 at step 2)."""
    import numpy as np

    alphas = np.linspace(1, 1 / 1000, 21)
    expected = np.flip(3 * (1 - alphas) / (1 + 2 * (1 - alphas)))[:-1].copy()
    old = unipc_policy(sigma_grid="diffusers-0.33")
    new = unipc_policy()
    old_sigmas, new_sigmas = old.sigmas(20), new.sigmas(20)
    torch.testing.assert_close(old_sigmas, torch.from_numpy(np.append(expected, 0.0)).float(), rtol=0, atol=0)
    gap = (old_sigmas - new_sigmas).abs()
    assert 0.0024 < float(gap.max()) < 0.0025 and int(gap.argmax()) == 19
    assert old._timestep_table[float(old_sigmas[2])] == 963 and new._timestep_table[float(new_sigmas[2])] == 964

    def test_frames_must_be_4k_plus_1(self, model_keys):
        from fgrpo.core.config import check_params
        from fgrpo.models.wan import WanPolicy

        _, errors = check_params(WanPolicy, {"path": "x", "num_frames": 6})
        assert [e.key for e in errors] == ["num_frames"] and "4k + 1" in str(errors[0])
