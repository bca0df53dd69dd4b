"""The flux-kontext backbone on a tiny random FluxKontextPipeline (FLUX.1 Kontext [dev]'s
structure), saved and loaded offline: our Euler loop against ``pipe(image=..., output_type="latent")``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.core import media
from fgrpo.core.media import Prompt
from fgrpo.core.testing import SyntheticImage
from fgrpo.models.testing import EditingBackboneConformance, build_tiny_flux_kontext_pipeline

SEQ = 16
#: sources of another size and aspect than the 64 x 64 output
PROMPTS = (
    Prompt("make the sky red", images=(SyntheticImage(1, 40, 24),)),
    Prompt("add two blue squares", images=(SyntheticImage(2, 40, 24),)),
)


class TestFluxKontext(EditingBackboneConformance):
    model_name = "flux-kontext"
    build_pipeline = staticmethod(build_tiny_flux_kontext_pipeline)
    model_params = {"max_sequence_length": SEQ, "guidance_scale": 2.5, "resolution": 64, "source_resolution": "output"}
    guidance_key = "true_cfg_scale"
    reward = {"name": "jpeg-compressibility"}
    prompts = PROMPTS

    def pipeline_kwargs(self, policy):
        h, w = policy.size
        return {
            "height": h,
            "width": w,
            "max_area": h * w,
            "max_sequence_length": SEQ,
            "guidance_scale": policy.guidance_scale,
        }

    def source_kwargs(self, policy, prompts):
        # source_resolution output: the sources at the output's size (flow_grpo resizes its reference
        # images to the resolution), which the pipeline keeps with _auto_resize=False
        h, w = policy.size
        images = [policy.pipeline.image_processor.resize(media.load_image(p.images[0]), h, w) for p in prompts]
        return {"image": images, "_auto_resize": False}

    def test_defaults(self, policy):
        assert policy.latent_shape == (16, 8, 8) and type(policy).source_image_count == (1, 1)
        cond = policy.encode(list(PROMPTS))
        assert set(cond) == {"prompt_embeds", "pooled_prompt_embeds", "image_latents"}
        assert cond["image_latents"].shape == (2, 16, 8, 8)  # the source at the output's 64 x 64

    @torch.no_grad()
    def test_source_changes_the_velocity_and_is_cached_per_prompt(self, policy):
        x, sigma = self.state(policy)
        same_text = [PROMPTS[0], Prompt(PROMPTS[0].text, images=(SyntheticImage(9, 40, 24),))]
        encoded = policy.prompt_cache.encoded
        cond = policy.encode(same_text)
        assert policy.prompt_cache.encoded - encoded <= 1  # one text, encoded once
        v = policy.velocity(x, sigma, cond)
        assert not torch.allclose(v[0], v[1])  # same text and noise level, other source: another edit
        before = policy.image_cache.encoded
        policy.encode(same_text)
        assert policy.image_cache.encoded == before


@torch.no_grad()
def test_preferred_resolution_is_the_pipelines_auto_resize(tmp_path):
    """source_resolution preferred: the Kontext resolution nearest the source's aspect ratio, as
    pipe(image=...) picks it (_auto_resize), through the same VAE encoding and ids."""
    from fgrpo.models.flux_kontext import FluxKontextPolicy

    pipe = build_tiny_flux_kontext_pipeline()
    policy = FluxKontextPolicy.from_pipeline(pipe, device="cpu", resolution=32, max_sequence_length=SEQ, lora=None)
    prompt = Prompt(
        "make it red", images=(SyntheticImage(5, 90, 50),)
    )  # 80 x 48 after rounding to 16: 1328 x 800, the nearest of 17
    assert policy._source_size(media.load_image(prompt.images[0])) == (800, 1328)
    cond = policy.encode([prompt])
    assert cond["image_latents"].shape == (1, 16, 100, 166)
    x = policy.initial_noise(1, torch.Generator().manual_seed(0))
    start, sigmas = x.clone(), policy.sigmas(2)
    for i in range(2):
        x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigmas[i].expand(1), cond)
    out = pipe(
        prompt=["make it red"],
        image=media.load_image(prompt.images[0]),
        latents=policy.to_pipeline_latents(start),
        height=32,
        width=32,
        max_area=32 * 32,
        num_inference_steps=2,
        guidance_scale=policy.guidance_scale,
        max_sequence_length=SEQ,
        output_type="latent",
    )[0]
    torch.testing.assert_close(x, policy.from_pipeline_latents(out).float(), rtol=0, atol=1e-4)
    other = Prompt("make it blue", images=(SyntheticImage(6, 50, 90),))  # tall: another preferred size
    [problem] = policy.check_prompts([prompt, other])
    assert "resizes the sources to 2 sizes (800x1328 for 'make it red'; 1328x800 for 'make it blue')" in problem
