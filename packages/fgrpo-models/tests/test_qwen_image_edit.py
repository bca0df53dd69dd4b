"""The qwen-image-edit and qwen-image-edit-plus backbones on tiny random QwenImageEdit(Plus)Pipelines
(the VL encoder sees the sources through a Qwen2-VL processor), saved and loaded offline: our Euler
loop against ``pipe(image=..., output_type="latent")``, with and without true CFG."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.core import media
from fgrpo.core.media import Prompt
from fgrpo.core.testing import SyntheticImage
from fgrpo.models.qwen_image_edit import CONDITION_IMAGE_AREA, VAE_IMAGE_AREA
from fgrpo.models.testing import EditingBackboneConformance, build_tiny_qwen_image_edit_pipeline

SEQ = 96


@contextlib.contextmanager
def source_area_is_the_output(pipe, height, width):
    """The edit pipelines resize sources to 1024 x 1024 pixels of their aspect ratio
    (calculate_dimensions(1024 * 1024, ...), not an argument): for a comparison at tiny sizes the
    function gives the output's size for that area; source_resolution output does the same."""
    module = sys.modules[type(pipe).__module__]
    real = module.calculate_dimensions
    # (the Edit module's returns (width, height, None), the Plus module's (width, height))
    module.calculate_dimensions = lambda area, ratio: (
        (width, height, *real(area, ratio)[2:]) if area == VAE_IMAGE_AREA else real(area, ratio)
    )
    try:
        yield
    finally:
        module.calculate_dimensions = real


class EditConformance(EditingBackboneConformance):
    reward = {"name": "jpeg-compressibility"}
    guidance_key = "true_cfg_scale"
    guidance_value = 4.0
    model_params = {"max_sequence_length": SEQ, "true_cfg_scale": 1.0, "resolution": 64, "source_resolution": "output"}

    def pipeline_kwargs(self, policy):
        h, w = policy.size
        return {"height": h, "width": w}

    def source_kwargs(self, policy, prompts):
        images = [media.load_image(ref) for p in prompts for ref in p.images]
        return {"image": images if len(images) > 1 else images[0]}

    def run_pipeline(self, policy, pipe, x, **options):
        """Row by row, each prompt's image(s) given alone: the Plus pipeline takes one prompt per
        call, and the Edit pipeline resizes a single image for its VL encoder but hands a list of
        images to it unresized (``VaeImageProcessor.resize`` passes lists through): the policy does
        what the one-image call does."""
        rows, prompts = [], self.prompts
        with source_area_is_the_output(pipe, *policy.size):
            for i in range(len(x)):
                self.prompts = (prompts[i % len(prompts)],)
                try:
                    rows.append(super().run_pipeline(policy, pipe, x[i : i + 1], **options))
                finally:
                    self.prompts = prompts
        return torch.cat(rows)


class TestQwenImageEdit(EditConformance):
    model_name = "qwen-image-edit"
    build_pipeline = staticmethod(build_tiny_qwen_image_edit_pipeline)
    prompts = (
        Prompt("make the sky red", images=(SyntheticImage(1, 48, 32),)),
        Prompt("add a cat", images=(SyntheticImage(2, 48, 32),)),
    )

    def test_defaults(self, policy):
        assert policy.latent_shape == (16, 8, 8) and type(policy).source_image_count == (1, 1)
        cond = policy.encode(list(self.prompts))
        assert set(cond) == {"prompt_embeds", "prompt_embeds_mask", "image_latents"}
        assert cond["image_latents"].shape == (2, 16, 8, 8) and cond["prompt_embeds"].shape[1] == SEQ

    @torch.no_grad()
    def test_the_vl_encoder_sees_the_source(self, policy):
        same_text = [self.prompts[0], Prompt(self.prompts[0].text, images=(SyntheticImage(9, 48, 32),))]
        cond = policy.encode(same_text)
        assert not torch.equal(
            cond["prompt_embeds"][0], cond["prompt_embeds"][1]
        )  # text embeddings depend on the image
        assert not torch.equal(cond["image_latents"][0], cond["image_latents"][1])

    def test_a_prompt_longer_than_max_sequence_length_is_an_error(self, model_keys):
        policy = self.make_policy(model_keys, max_sequence_length=8)
        with pytest.raises(ValueError, match="tokens with its image tokens; model.max_sequence_length is 8"):
            policy.encode([self.prompts[0]])


class TestQwenImageEditPlus(EditConformance):
    model_name = "qwen-image-edit-plus"
    build_pipeline = staticmethod(lambda path: build_tiny_qwen_image_edit_pipeline(path, plus=True))
    prompts = (  # two sources each, of two aspect ratios
        Prompt("put the cat on the sofa", images=(SyntheticImage(1, 48, 32), SyntheticImage(3, 32, 40))),
        Prompt("swap their colours", images=(SyntheticImage(2, 48, 32), SyntheticImage(4, 32, 40))),
    )

    def test_defaults(self, policy):
        assert type(policy).source_image_count == (1, 3)
        cond = policy.encode(list(self.prompts))
        assert set(cond) == {"prompt_embeds", "prompt_embeds_mask", "image_latents_0", "image_latents_1"}
        assert (
            cond["image_latents_0"].shape == cond["image_latents_1"].shape == (2, 16, 8, 8)
        )  # both at the output's size
        [problem] = policy.check_prompts([self.prompts[0], Prompt("one", images=(SyntheticImage(5),))])
        assert "the prompts have [1, 2] source images" in problem

    def test_vl_images_are_384_square_pixels_of_their_aspect(self, policy):
        sizes = [image.size for image in policy._vl_images(self.prompts[0])]
        assert sizes == [(480, 320), (352, 416)]  # (width, height): 384 x 384 pixels of 3:2 and 4:5, rounded to 32
        assert all(abs(w * h - CONDITION_IMAGE_AREA) / CONDITION_IMAGE_AREA < 0.08 for w, h in sizes)


@torch.no_grad()
def test_preferred_source_size_is_the_pipelines():
    from fgrpo.models.qwen_image_edit import QwenImageEditPolicy

    policy = QwenImageEditPolicy.from_pipeline(
        build_tiny_qwen_image_edit_pipeline(), device="cpu", resolution=32, lora=None
    )
    assert policy._source_size(SyntheticImage(0, 90, 50).to_pil()) == (
        768,
        1376,
    )  # 1024^2 pixels at 9:5, multiples of 32
    assert policy._source_size(SyntheticImage(0, 64, 64).to_pil()) == (1024, 1024)
    fixed = QwenImageEditPolicy.from_pipeline(
        build_tiny_qwen_image_edit_pipeline(), device="cpu", resolution=32, lora=None, source_resolution=[1024, 1024]
    )
    assert fixed._source_size(SyntheticImage(0, 90, 50).to_pil()) == (
        1024,
        1024,
    )  # flow_grpo: squashed square, then 1024^2
