"""The hunyuan-video-1.5 backbone on a tiny random HunyuanVideo15Pipeline (text-to-video), saved and loaded offline."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.models.testing import DiffusersBackboneConformance, build_tiny_hunyuan_video15_pipeline

SEQ, GLYPHS = 24, 16


class TestHunyuanVideo15(DiffusersBackboneConformance):
    model_name = "hunyuan-video-1.5"
    build_pipeline = staticmethod(build_tiny_hunyuan_video15_pipeline)
    model_params = {
        "max_sequence_length": SEQ,
        "glyph_sequence_length": GLYPHS,
        "resolution": 64,
        "num_frames": 5,
        "guidance_scale": 1.0,
    }
    prompts = ('a sign that says "fgrpo"', "a cat")  # one with quoted (glyph) text, one without
    guidance_key = "guidance_scale"
    reward = {"name": "jpeg-compressibility", "frame_stride": 2}

    def pipeline_kwargs(self, policy):
        return {"height": 64, "width": 64, "num_frames": 5}

    def guidance_kwargs(self, policy):
        """The pipeline takes its guidance from its guider: set the guider's scale instead."""
        policy.pipeline.guider = type(policy.pipeline.guider)(guidance_scale=policy.guidance_scale)
        return {}

    @torch.no_grad()
    def test_decode_is_the_pipelines(self, policy):
        """Row by row: diffusers 0.42's HunyuanVideo 1.5 VAE decodes one video at a time (its causal
        attention mask breaks on a batch), in the pipeline as in the policy."""
        from fgrpo.models.testing.conformance import assert_matches

        x = policy.initial_noise(2, torch.Generator().manual_seed(4))
        for row in range(2):
            latents = self.run_pipeline(policy, policy.pipeline, x[row : row + 1], steps=2)
            pixels = self.run_pipeline(policy, policy.pipeline, x[row : row + 1], output_type="pt", steps=2)
            assert_matches(
                self.label or self.model_name, "decode vs pipeline", policy.decode(latents), pixels.float(), 1e-5
            )

    def test_defaults_come_from_the_pipeline(self, pretrained_path):
        policy = self.make_policy(
            {"path": pretrained_path, "device": "cpu", "lora": {"rank": 2}, "num_frames": 5, "resolution": 64}
        )
        assert policy.guidance_scale == 6.0 and policy.cfg and policy.evaluations_per_call == 2  # the tiny guider's
        assert policy.latent_shape == (32, 2, 4, 4)

    def test_template_and_glyphs(self, policy):
        cond = policy.encode(list(self.prompts))
        assert cond["prompt_embeds"].shape[:2] == cond["prompt_embeds_mask"].shape == (2, SEQ)
        assert cond["prompt_embeds_mask_2"].shape == (2, GLYPHS)
        assert (
            cond["prompt_embeds_mask_2"][0].sum() > 0 and cond["prompt_embeds_mask_2"][1].sum() == 0
        )  # only a quote has glyphs
        tokens = policy.pipeline.tokenizer.apply_chat_template(
            [[{"role": "system", "content": policy.pipeline.system_message}, {"role": "user", "content": "a cat"}]],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"][0]
        assert policy.pipeline.tokenizer.decode(tokens[108:]).startswith(
            "a cat"
        )  # the crop removes exactly the template

    def test_a_step_ranged_guider_is_refused(self, pretrained_path):
        from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

        pipe = HunyuanVideo15Pipeline.from_pretrained(pretrained_path)
        pipe.guider = ClassifierFreeGuidance(guidance_scale=6.0, start=0.2)
        from fgrpo.models.hunyuan_video import HunyuanVideo15Policy

        with pytest.raises(ValueError, match="start 0 and stop 1"):
            HunyuanVideo15Policy.from_pipeline(pipe, device="cpu", num_frames=5, resolution=64)

    @torch.no_grad()
    def test_guidance_rescale_is_the_guiders(self, model_keys):
        policy = self.make_policy(
            {**model_keys, "lora": {**self.lora, "init": "random"}}, guidance_scale=5.0, guidance_rescale=0.7
        )
        x = policy.initial_noise(2, torch.Generator().manual_seed(3))
        start, sigmas, cond = x.clone(), policy.sigmas(3), self.cond(policy)
        for i in range(3):
            x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigmas[i].expand(2), cond)
        pipe = policy.pipeline
        pipe.guider = type(pipe.guider)(guidance_scale=5.0, guidance_rescale=0.7)
        reference = pipe(
            prompt=list(self.prompts),
            negative_prompt=["", ""],
            latents=start.clone(),
            num_inference_steps=3,
            output_type="latent",
            **self.pipeline_kwargs(policy),
        )[0]
        from fgrpo.models.testing.conformance import assert_matches

        assert_matches(
            self.label or self.model_name,
            "euler loop vs pipeline, guidance_rescale",
            x,
            reference.float(),
            self.pipeline_atol,
        )


def _load_into_transformer(self, pipe, folder, written):
    """diffusers 0.42 gives HunyuanVideo15Pipeline no LoRA loader: the transformer's own
    ``load_lora_adapter`` reads the export (diffusers' file layout, rank and alpha in its metadata)."""
    import os

    assert sorted(os.path.basename(f) for f in written) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "pytorch_lora_weights.safetensors",
    ]
    assert not hasattr(pipe, "load_lora_weights")
    pipe.transformer.load_lora_adapter(folder, weight_name="pytorch_lora_weights.safetensors", prefix="transformer")


TestHunyuanVideo15.load_export = _load_into_transformer
