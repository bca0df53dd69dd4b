"""The qwen-image backbone on a tiny random QwenImagePipeline, saved and loaded offline."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.models.testing import DiffusersBackboneConformance, build_tiny_qwen_image_pipeline

SEQ = 32


class TestQwenImage(DiffusersBackboneConformance):
    model_name = "qwen-image"
    build_pipeline = staticmethod(build_tiny_qwen_image_pipeline)
    model_params = {"max_sequence_length": SEQ, "resolution": 64, "true_cfg_scale": 1.0}
    prompts = ("a red circle to the left of a cat", "hi")  # different lengths: the padding mask matters
    guidance_key = "true_cfg_scale"
    reward = {"name": "jpeg-compressibility"}

    def pipeline_kwargs(self, policy):
        return {"height": 64, "width": 64, "max_sequence_length": SEQ}

    def test_template_and_padding(self, policy):
        assert policy.pipeline.prompt_template_encode_start_idx == 34  # the tiny tokenizer keeps the real count
        cond = policy.encode(list(self.prompts))
        mask = cond["prompt_embeds_mask"]
        assert cond["prompt_embeds"].shape[:2] == mask.shape == (2, SEQ)  # fixed width: batches concatenate
        lengths = mask.sum(dim=1)
        assert lengths[0] > lengths[1] and torch.all(cond["prompt_embeds"][1, int(lengths[1]) :] == 0)
        embeds, pipe_mask = policy.pipeline.encode_prompt(
            [self.prompts[1]], device=policy.device, max_sequence_length=SEQ
        )
        torch.testing.assert_close(cond["prompt_embeds"][1:, : embeds.shape[1]], embeds, rtol=0, atol=1e-5)


@torch.no_grad()
def test_text_padding_mask_keeps_a_samples_velocity_independent_of_its_batch():
    """Kept from flow_grpo on purpose (its diffusers ignored the mask it passed, diffusers#12294):
    unmasked, the padding a short prompt gets from a longer one in the same forward batch changes
    its velocity, so a rollout and an update that batch prompts differently disagree (the first
    ratio is no longer 1). ``text_padding_mask: false`` reproduces flow_grpo."""
    from fgrpo.models.qwen_image import QwenImagePolicy

    def velocities(policy):
        short, long = "hi", "a red circle to the left of a cat"
        x = policy.initial_noise(2, torch.Generator().manual_seed(0))
        sigma = torch.full((2,), 0.6)
        together = policy.velocity(x, sigma, policy.encode([short, long]))[0]
        alone = policy.velocity(x[:1], sigma[:1], policy.encode([short]))[0]
        return together, alone

    keys = {"device": "cpu", "max_sequence_length": SEQ, "resolution": 64, "true_cfg_scale": 1.0}
    masked = QwenImagePolicy.from_pipeline(build_tiny_qwen_image_pipeline(), **keys)
    together, alone = velocities(masked)
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    unmasked = QwenImagePolicy.from_pipeline(build_tiny_qwen_image_pipeline(), text_padding_mask=False, **keys)
    together, alone = velocities(unmasked)
    assert (together - alone).abs().max() > 1e-3
