"""The sd3 backbone on a tiny random StableDiffusion3Pipeline, saved and loaded offline."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.core.config import check_params
from fgrpo.core.protocols import Policy
from fgrpo.core.testing.tiny_pipelines import build_tiny_sd3_pipeline
from fgrpo.models.sd3 import SD3_LORA_TARGETS, SD3Policy

PROMPTS = ["a red circle", "a blue square"]
SEQ = 16  # T5 tokens: keeps the tiny encoders fast


@pytest.fixture(scope="module")
def sd3_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-sd3")
    build_tiny_sd3_pipeline(path)
    return str(path)


def make(path, **keys):
    keys.setdefault("device", "cpu")
    keys.setdefault("max_sequence_length", SEQ)
    keys.setdefault("lora", {"rank": 4, "alpha": 8, "init": "random"})
    torch.manual_seed(0)  # the "random" LoRA init draws from the global RNG
    return SD3Policy(path=path, **keys)


def noise(policy, n=2, seed=0):
    return policy.initial_noise(n, torch.Generator().manual_seed(seed))


def test_protocol_and_shapes(sd3_path):
    policy = make(sd3_path)
    assert isinstance(policy, Policy)
    assert policy.device == torch.device("cpu")
    assert policy.evaluations_per_call == 1
    assert policy.resolution == 64 and policy.latent_shape == (16, 8, 8)
    cond = policy.encode(PROMPTS)
    assert set(cond) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert cond["prompt_embeds"].shape == (2, 77 + SEQ, 64)
    assert cond["pooled_prompt_embeds"].shape == (2, 64)
    x = noise(policy)
    assert x.shape == (2, 16, 8, 8) and x.dtype == torch.float32
    sigmas = policy.sigmas(4)
    assert sigmas.shape == (5,) and sigmas[0] == 1 and sigmas[-1] == 0
    assert torch.all(sigmas[1:] < sigmas[:-1])
    with torch.no_grad():
        v = policy.velocity(x, sigmas[0].expand(2), cond)
        assert torch.equal(v, policy.velocity(x, sigmas[0], cond))  # a scalar sigma broadcasts
    assert v.shape == x.shape and v.dtype == torch.float32
    # LoRA on both attention streams by default
    default = SD3Policy.__attrs_attrs__.lora.default.factory()
    assert default["rank"] == 32 and default["alpha"] == 64
    assert set(default["target_modules"]) == set(SD3_LORA_TARGETS)


def test_sigmas_are_the_pipeline_schedule(sd3_path):
    policy = make(sd3_path)
    scheduler = policy.pipeline.scheduler
    for steps in (1, 4, 10):
        scheduler.set_timesteps(steps)
        assert torch.equal(policy.sigmas(steps), scheduler.sigmas.float())
    assert policy.shift == 3.0
    flat = make(sd3_path, shift=1.0).sigmas(4)
    assert torch.all(flat[1:-1] < policy.sigmas(4)[1:-1])  # shift 3 keeps more noise


def test_encode_is_cached_per_prompt(sd3_path, monkeypatch):
    policy = make(sd3_path, guidance_scale=4.5)
    calls = []
    original = policy.pipeline.encode_prompt

    def counting(**kwargs):
        calls.append(list(kwargs["prompt"]))
        return original(**kwargs)

    monkeypatch.setattr(policy.pipeline, "encode_prompt", counting)
    first = policy.encode(["a", "b", "a"])
    assert calls == [["a", "b"], [""]]  # distinct prompts once, then the empty negative
    assert torch.equal(first["prompt_embeds"][0], first["prompt_embeds"][2])
    again = policy.encode(["b", "a"])
    assert len(calls) == 2  # nothing re-encoded
    assert torch.equal(again["prompt_embeds"][0], first["prompt_embeds"][1])
    assert again["negative_prompt_embeds"].shape == again["prompt_embeds"].shape
    # the cached rows equal a fresh batched encoding
    embeds, _, pooled, _ = original(
        prompt=["b", "a"], prompt_2=None, prompt_3=None, device=policy.device,
        do_classifier_free_guidance=False, max_sequence_length=SEQ,
    )
    torch.testing.assert_close(again["prompt_embeds"], embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(again["pooled_prompt_embeds"], pooled, rtol=0, atol=1e-6)
    assert not again["prompt_embeds"].requires_grad


def test_prompt_cache_is_bounded(sd3_path):
    policy = make(sd3_path, prompt_cache_size=2)
    policy.encode(["a", "b", "c"])
    assert len(policy.prompt_cache) == 2 and "a" not in policy.prompt_cache
    nocache = make(sd3_path, prompt_cache_size=0)
    nocache.encode(["a"])
    nocache.encode(["a"])
    assert len(nocache.prompt_cache) == 0 and nocache.prompt_cache.encoded == 2


@torch.no_grad()
def test_reference_is_the_base_model_and_adapter_comes_back(sd3_path):
    policy = make(sd3_path)
    base = make(sd3_path, lora=None)  # the same weights without any adapter
    cond = policy.encode(PROMPTS)
    x, sigma = noise(policy), torch.tensor([0.9, 0.4])
    tuned = policy.velocity(x, sigma, cond)
    plain = base.velocity(x, sigma, cond)
    assert (tuned - plain).abs().max() > 1e-3  # the random LoRA changes the outputs
    with policy.reference():
        assert torch.equal(policy.velocity(x, sigma, cond), plain)
        with policy.reference():  # nesting keeps the adapter off until the outermost exit
            pass
        assert torch.equal(policy.velocity(x, sigma, cond), plain)
    assert torch.equal(policy.velocity(x, sigma, cond), tuned)
    assert all(p.requires_grad for p in policy.trainable_parameters())
    with pytest.raises(RuntimeError, match="full fine-tuning"):
        with base.reference():
            pass


@torch.no_grad()
def test_classifier_free_guidance(sd3_path):
    plain = make(sd3_path, lora=None)
    guided = make(sd3_path, lora=None, guidance_scale=4.5)
    assert plain.evaluations_per_call == 1 and guided.evaluations_per_call == 2
    cond = guided.encode(PROMPTS)
    assert cond["negative_prompt_embeds"].shape == cond["prompt_embeds"].shape
    x, sigma = noise(plain), torch.tensor([0.7, 0.7])
    v_cond = plain.velocity(x, sigma, {k: cond[k] for k in ("prompt_embeds", "pooled_prompt_embeds")})
    v_uncond = plain.velocity(
        x, sigma,
        {"prompt_embeds": cond["negative_prompt_embeds"], "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"]},
    )
    assert torch.equal(plain.velocity(x, sigma, cond), v_cond)  # guidance 1 ignores the negative
    expected = v_uncond + 4.5 * (v_cond - v_uncond)
    torch.testing.assert_close(guided.velocity(x, sigma, cond), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="negative"):
        guided.velocity(x, sigma, {k: cond[k] for k in ("prompt_embeds", "pooled_prompt_embeds")})


@pytest.mark.parametrize("guidance", [1.0, 3.0])
@torch.no_grad()
def test_euler_loop_reproduces_the_pipeline(sd3_path, guidance):
    """x' = x + (sigma' - sigma) v over sigmas(steps) == pipe(output_type="latent"): proves the
    velocity sign, the timestep scaling (sigma x 1000), the CFG order and the schedule."""
    policy = make(sd3_path, guidance_scale=guidance)
    steps = 4
    x = noise(policy, seed=3)
    start = x.clone()
    sigmas = policy.sigmas(steps)
    cond = policy.encode(PROMPTS)
    for i in range(steps):
        v = policy.velocity(x, sigmas[i].expand(len(x)), cond)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    reference = policy.pipeline(
        prompt=PROMPTS, latents=start, num_inference_steps=steps, guidance_scale=guidance,
        max_sequence_length=SEQ, output_type="latent",
    ).images
    torch.testing.assert_close(x, reference, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_decode_matches_the_pipeline(sd3_path):
    policy = make(sd3_path)
    latents = noise(policy)
    images = policy.decode(latents)
    assert images.shape == (2, 3, 64, 64) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    vae, pipe = policy.pipeline.vae, policy.pipeline
    raw = vae.decode(latents / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    torch.testing.assert_close(images, pipe.image_processor.postprocess(raw, output_type="pt"), rtol=0, atol=1e-6)


def test_trainable_state_dict_round_trip(sd3_path, tmp_path):
    from safetensors.torch import save_file

    policy = make(sd3_path)
    state = policy.trainable_state_dict()
    assert state and all("lora_" in k for k in state)
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in state.values())
    cond, x, sigma = policy.encode(PROMPTS), noise(policy), torch.tensor([0.5, 0.5])
    with torch.no_grad():
        before = policy.velocity(x, sigma, cond)
        policy.load_trainable_state_dict({k: torch.randn_like(v) for k, v in state.items()})
        assert not torch.equal(policy.velocity(x, sigma, cond), before)
        policy.load_trainable_state_dict(state)
        assert torch.equal(policy.velocity(x, sigma, cond), before)
    with pytest.raises(ValueError, match="missing"):
        policy.load_trainable_state_dict(dict(list(state.items())[1:]))
    # lora_path: the same weights loaded into a fresh policy (default LoRA init: B = 0)
    save_file(state, str(tmp_path / "adapter.safetensors"))
    loaded = make(sd3_path, lora={"rank": 4, "alpha": 8}, lora_path=str(tmp_path / "adapter.safetensors"))
    with torch.no_grad():
        assert torch.equal(loaded.velocity(x, sigma, cond), before)
    # a folder in diffusers' save_lora_weights layout ("transformer." prefix)
    (tmp_path / "lora").mkdir()
    save_file({f"transformer.{k}": v for k, v in state.items()}, str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    loaded = make(sd3_path, lora={"rank": 4, "alpha": 8}, lora_path=str(tmp_path / "lora"))
    with torch.no_grad():
        assert torch.equal(loaded.velocity(x, sigma, cond), before)
    # full fine-tuning: the whole transformer
    full = make(sd3_path, lora=None)
    assert set(full.trainable_state_dict()) == set(full.transformer.state_dict())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_backward_reaches_only_the_adapter(sd3_path, checkpointing):
    policy = make(sd3_path, gradient_checkpointing=checkpointing, guidance_scale=2.0)
    cond = policy.encode(PROMPTS)
    loss = policy.velocity(noise(policy), torch.tensor([0.8, 0.3]), cond).square().mean()
    loss.backward()
    trainable = {id(p) for p in policy.trainable_parameters()}
    assert trainable
    pipe = policy.pipeline
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        for name, p in module.named_parameters():
            if id(p) in trainable:
                assert "lora_" in name and p.grad is not None and torch.isfinite(p.grad).all()
            else:
                assert p.grad is None and not p.requires_grad, name
    assert any(p.grad.abs().sum() > 0 for p in policy.trainable_parameters())
    if checkpointing:  # same gradients with and without recomputation
        other = make(sd3_path, guidance_scale=2.0)
        other.load_trainable_state_dict(policy.trainable_state_dict())
        other.velocity(noise(other), torch.tensor([0.8, 0.3]), other.encode(PROMPTS)).square().mean().backward()
        for a, b in zip(policy.trainable_parameters(), other.trainable_parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_bfloat16_on_cpu(sd3_path):
    policy = make(sd3_path, dtype="bfloat16")
    assert policy.transformer.dtype == torch.bfloat16
    assert policy.pipeline.text_encoder_3.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())  # LoRA kept in fp32
    cond = policy.encode(PROMPTS)
    assert cond["prompt_embeds"].dtype == torch.bfloat16
    v = policy.velocity(noise(policy), torch.tensor([0.6, 0.6]), cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    v.square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in policy.trainable_parameters())
    with torch.no_grad():
        images = policy.decode(noise(policy))
    assert images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1


def test_from_pipeline_and_resolution():
    pipe = build_tiny_sd3_pipeline(sample_size=8)
    policy = SD3Policy.from_pipeline(pipe, device="cpu", lora=None, resolution=32, max_sequence_length=SEQ)
    assert policy.pipeline is pipe and policy.latent_shape == (16, 4, 4)
    assert policy.trainable_parameters() and all(p.requires_grad for p in policy.trainable_parameters())
    with torch.no_grad():
        v = policy.velocity(noise(policy), torch.tensor([0.5, 0.5]), policy.encode(PROMPTS))
    assert v.shape == (2, 16, 4, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        SD3Policy.from_pipeline(build_tiny_sd3_pipeline(), device="cpu", resolution=40)


def test_recipe_keys_are_checked():
    out, errors = check_params(SD3Policy, {"path": "x", "lora": {"rank": 0}, "dtype": "bf16"})
    assert not errors and out["lora"] is None and out["device"] == "auto"
    out, errors = check_params(SD3Policy, {"path": "x", "lora": {"rank": 8}})
    assert out["lora"] == {"rank": 8, "alpha": 64, "target_modules": list(SD3_LORA_TARGETS), "init": "default"}
    _, errors = check_params(
        SD3Policy,
        {"path": "x", "lora": {"rnak": 8}, "dtype": "float64", "device": "gpu", "guidance_scale": 0.5, "pipeline": 1},
    )
    keys = sorted(e.key for e in errors)
    assert keys == ["device", "dtype", "guidance_scale", "lora", "pipeline"], errors
    assert "rnak" in next(str(e) for e in errors if e.key == "lora")
    _, errors = check_params(SD3Policy, {})
    assert [e.key for e in errors] == ["path"]


def test_built_through_the_registry(sd3_path):
    from fgrpo.core import registry

    assert registry.load("model", "sd3") is SD3Policy
    policy = registry.create(
        "model", "sd3", path=sd3_path, device="cpu", max_sequence_length=SEQ, lora={"rank": 2}, guidance_scale=4.5
    )
    assert policy.lora == {"rank": 2, "alpha": 64, "target_modules": list(SD3_LORA_TARGETS), "init": "default"}
    assert policy.evaluations_per_call == 2
    assert sum(p.numel() for p in policy.trainable_parameters()) > 0


def test_importing_the_module_does_not_import_diffusers():
    code = "import sys, fgrpo.models.sd3; assert 'diffusers' not in sys.modules and 'peft' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
