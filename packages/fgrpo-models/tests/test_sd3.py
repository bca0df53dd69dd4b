"""The sd3 backbone on a tiny random StableDiffusion3Pipeline, saved and loaded offline."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.core.config import check_params
from fgrpo.models.sd3 import SD3_LORA_TARGETS, SD3Policy
from fgrpo.models.testing import DiffusersBackboneConformance, build_tiny_sd3_pipeline

SEQ = 16  # T5 tokens: keeps the tiny encoders fast


class TestSD3(DiffusersBackboneConformance):
    model_name = "sd3"
    build_pipeline = staticmethod(lambda path: build_tiny_sd3_pipeline(path, sd35=True))
    model_params = {"max_sequence_length": SEQ}
    guidance_key = "guidance_scale"
    reward = {"name": "jpeg-compressibility"}

    def pipeline_kwargs(self, policy):
        return {"height": 64, "width": 64, "max_sequence_length": SEQ}

    def test_defaults_and_schedule(self, policy):
        assert policy.resolution == 64 and policy.latent_shape == (16, 8, 8)
        assert policy.lora["target_modules"] == list(SD3_LORA_TARGETS)
        default = check_params(SD3Policy, {"path": "x"})[0]["lora"]
        assert default == {"rank": 32, "alpha": 64, "target_modules": list(SD3_LORA_TARGETS), "init": "gaussian"}
        scheduler = policy.pipeline.scheduler
        for steps in (1, 10):
            scheduler.set_timesteps(steps)
            assert torch.equal(policy.sigmas(steps), scheduler.sigmas.float())
        flat = self.make_policy({"path": policy.path, "device": "cpu", "max_sequence_length": SEQ}, shift=1.0).sigmas(
            4
        )
        assert torch.all(flat[1:-1] < policy.sigmas(4)[1:-1])  # the pipeline's shift 3 keeps more noise

    @torch.no_grad()
    def test_text_encoders_elsewhere_and_decoding_in_chunks(self, policy, model_keys):
        other = self.make_policy(model_keys, text_encoder_device="cpu", decode_batch_size=1)
        assert all(p.device.type == "cpu" for m in other.text_encoders() for p in m.parameters())
        cond, expected = other.encode(list(self.prompts)), policy.encode(list(self.prompts))
        for key in expected:
            assert cond[key].device == other.device
            torch.testing.assert_close(cond[key], expected[key], rtol=0, atol=1e-6)
        x = policy.initial_noise(3, torch.Generator().manual_seed(5))
        torch.testing.assert_close(other.decode(x), policy.decode(x), rtol=0, atol=1e-5)


def test_from_pipeline_and_resolution():
    pipe = build_tiny_sd3_pipeline(sample_size=8)
    policy = SD3Policy.from_pipeline(pipe, device="cpu", lora=None, resolution=32, max_sequence_length=SEQ)
    assert policy.pipeline is pipe and policy.latent_shape == (16, 4, 4) and policy.size == (32, 32)
    with torch.no_grad():
        v = policy.velocity(policy.initial_noise(2), torch.tensor([0.5, 0.5]), policy.encode(["a", "b"]))
    assert v.shape == (2, 16, 4, 4)
    assert SD3Policy.from_pipeline(build_tiny_sd3_pipeline(), device="cpu", resolution=[32, 48]).latent_shape == (
        16,
        4,
        6,
    )
    with pytest.raises(ValueError, match="multiples of 16"):
        SD3Policy.from_pipeline(build_tiny_sd3_pipeline(), device="cpu", resolution=40)


@torch.no_grad()
def test_vae_and_text_encoders_keep_their_own_dtype_and_run_without_autocast():
    """flow_grpo's precision (train_sd3.py:409-415, config/base.py:24): the transformer in float32
    under fp16 autocast, the VAE in float32, the text encoders in the autocast dtype; here three
    keys, and an autocast around decoding or encoding changes nothing (the pipeline runs neither
    under one)."""
    keys = {"device": "cpu", "max_sequence_length": SEQ, "lora": None}
    policy = SD3Policy.from_pipeline(
        build_tiny_sd3_pipeline(), dtype="float32", vae_dtype="float32", text_encoder_dtype="bfloat16", **keys
    )
    assert policy.transformer.dtype == torch.float32 and policy.pipeline.vae.dtype == torch.float32
    assert [m.dtype for m in policy.text_encoders()] == [torch.bfloat16] * 3
    x = policy.initial_noise(2, torch.Generator().manual_seed(0))
    plain, cond = policy.decode(x), policy.encode(["a cat"])
    policy.prompt_cache.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(policy.decode(x), plain)
        assert all(torch.equal(v, cond[k]) for k, v in policy.encode(["a cat"]).items())
    whole = SD3Policy.from_pipeline(
        build_tiny_sd3_pipeline(), dtype="bfloat16", **keys
    )  # dtype alone: everything bf16
    assert whole.pipeline.vae.dtype == torch.bfloat16 and (whole.decode(x) - plain).abs().max() > 1e-3


def test_recipe_keys_are_checked():
    out, errors = check_params(SD3Policy, {"path": "x", "lora": {"rank": 0}, "dtype": "bf16"})
    assert not errors and out["lora"] is None and out["device"] == "auto"
    out, errors = check_params(SD3Policy, {"path": "x", "lora": {"rank": 8}})
    assert out["lora"] == {"rank": 8, "alpha": 16, "target_modules": list(SD3_LORA_TARGETS), "init": "gaussian"}
    _, errors = check_params(
        SD3Policy,
        {
            "path": "x",
            "lora": {"rnak": 8},
            "dtype": "float64",
            "device": "gpu",
            "guidance_scale": 0.5,
            "pipeline": 1,
            "resolution": [64],
            "text_encoder_device": "tpu",
        },
    )
    keys = sorted(e.key for e in errors)
    assert keys == ["device", "dtype", "guidance_scale", "lora", "pipeline", "resolution", "text_encoder_device"], (
        errors
    )
    assert "rnak" in next(str(e) for e in errors if e.key == "lora")
    _, errors = check_params(SD3Policy, {})
    assert [e.key for e in errors] == ["path"]


def test_importing_the_backbones_does_not_import_diffusers():
    code = (
        "import sys, fgrpo.models.sd3, fgrpo.models.flux, fgrpo.models.qwen_image, fgrpo.models.wan, "
        "fgrpo.models.testing; "
        "assert 'diffusers' not in sys.modules and 'peft' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
