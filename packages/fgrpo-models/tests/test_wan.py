"""The wan backbone on a tiny random WanPipeline (Wan 2.1 text-to-video), saved and loaded offline."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from fgrpo.models.testing import DiffusersBackboneConformance, build_tiny_wan_pipeline
from fgrpo.models.testing.conformance import assert_matches

SEQ = 16


class TestWan(DiffusersBackboneConformance):
    model_name = "wan"
    label = "wan (2.1 T2V)"
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


# --- Wan 2.2 ------------------------------------------------------------------------------------

from fgrpo.models.testing import (  # noqa: E402 - the Wan 2.2 section's own imports
    build_tiny_wan22_i2v_pipeline,
    build_tiny_wan22_pipeline,
    build_tiny_wan22_ti2v_pipeline,
)

WAN_KWARGS = {"height": 32, "width": 32, "num_frames": 5, "max_sequence_length": SEQ}


def expert_calls(policy, fn):
    """(expert, rounded timestep) of every expert forward while ``fn`` runs."""
    calls, handles = [], []
    for name in ("transformer", "transformer_2"):
        module = getattr(policy.pipeline, name)

        def hook(_module, _args, kwargs, name=name):
            t = kwargs["timestep"].flatten()
            calls.append((name, tuple(round(float(v), 2) for v in t.unique())))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return calls


class TestWan22(DiffusersBackboneConformance):
    """Wan 2.2 T2V-A14B's structure: two experts, boundary 0.875; with shift 3 and 3 steps the
    timesteps are 1000 (high-noise expert), 751 and 9 (low-noise expert)."""

    model_name = "wan"
    label = "wan (2.2 T2V-A14B)"
    build_pipeline = staticmethod(build_tiny_wan22_pipeline)
    model_params = {"max_sequence_length": SEQ, "resolution": 32, "num_frames": 5, "guidance_scale": 1.0}
    guidance_key = "guidance_scale"
    reward = {"name": "jpeg-compressibility", "frame_stride": 2}

    def pipeline_kwargs(self, policy):
        return dict(WAN_KWARGS)

    def load_export(self, pipe, folder, written):
        import os

        assert sorted(os.path.relpath(f, folder) for f in written) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "pytorch_lora_weights.safetensors",
            "pytorch_lora_weights_transformer_2.safetensors",
            "transformer_2/adapter_config.json",
            "transformer_2/adapter_model.safetensors",
        ]
        pipe.load_lora_weights(folder)  # the high-noise expert, as for any pipeline
        pipe.load_lora_weights(
            folder, weight_name="pytorch_lora_weights_transformer_2.safetensors", load_into_transformer_2=True
        )

    @torch.no_grad()
    def test_each_expert_runs_at_the_pipelines_timesteps(self, policy):
        x = policy.initial_noise(2, torch.Generator().manual_seed(3))
        sigmas, cond = policy.sigmas(3), self.cond(policy)

        def ours():
            y = x.clone()
            for i in range(3):
                y = y + (sigmas[i + 1] - sigmas[i]) * policy.velocity(y, sigmas[i].expand(2), cond)

        theirs = expert_calls(policy, lambda: self.run_pipeline(policy, policy.pipeline, x))
        assert expert_calls(policy, ours) == theirs
        assert [(name, t[0] >= 875) for name, t in theirs] == [
            ("transformer", True),
            ("transformer_2", False),
            ("transformer_2", False),
        ]
        assert policy.high_noise(sigmas[:-1]).tolist() == [True, False, False]

    @torch.no_grad()
    def test_a_mixed_batch_routes_every_row_to_its_expert(self, policy):
        x, _ = self.state(policy, n=2)
        sigmas, cond = policy.sigmas(3), self.cond(policy)
        mixed = torch.stack([sigmas[1], sigmas[0]])  # row 0 low-noise, row 1 high-noise
        with self.perturbed(policy):
            both = policy.velocity(x, mixed, cond)
            calls = expert_calls(policy, lambda: policy.velocity(x, mixed, cond))
            for row in range(2):
                alone = policy.velocity(
                    x[row : row + 1], mixed[row : row + 1], {k: v[row : row + 1] for k, v in cond.items()}
                )
                torch.testing.assert_close(both[row : row + 1], alone, rtol=0, atol=1e-6)
        assert [name for name, _ in calls] == ["transformer", "transformer_2"]  # one forward per expert

    @torch.no_grad()
    def test_forward_groups_are_the_experts_velocity_runs(self, policy):
        """The policy's forward groups (what a sharded update keeps in lockstep): per row, the
        expert ``velocity`` calls, high-noise first; each group's level runs that group's expert."""
        groups = policy.forward_groups
        sigmas = policy.sigmas(3)[:-1]
        assert groups.of(sigmas).tolist() == [0 if high else 1 for high in policy.high_noise(sigmas).tolist()]
        assert groups.of(torch.tensor(groups.levels)).tolist() == [0, 1]
        x, _ = self.state(policy, n=1)
        cond = self.cond(policy, n=1)
        for level, expert in zip(groups.levels, ["transformer", "transformer_2"], strict=True):
            calls = expert_calls(policy, lambda level=level: policy.velocity(x, torch.tensor([level]), cond))
            assert [name for name, _ in calls] == [expert]

    @torch.no_grad()
    def test_the_low_noise_experts_own_guidance_scale(self, model_keys):
        """guidance_scale for the high-noise expert, guidance_scale_2 for the low-noise one, as the pipeline."""
        policy = self.make_policy(
            {**model_keys, "lora": {**self.lora, "init": "random"}}, guidance_scale=4.0, guidance_scale_2=2.0
        )
        x = policy.initial_noise(2, torch.Generator().manual_seed(3))
        start, sigmas, cond = x.clone(), policy.sigmas(3), self.cond(policy)
        for i in range(3):
            x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigmas[i].expand(2), cond)
        reference = policy.pipeline(
            prompt=list(self.prompts),
            negative_prompt=["", ""],
            latents=start.clone(),
            num_inference_steps=3,
            output_type="latent",
            guidance_scale=4.0,
            guidance_scale_2=2.0,
            **WAN_KWARGS,
        )[0]
        assert_matches(
            self.label, "euler loop vs pipeline, guidance_scale_2", x, reference.float(), self.pipeline_atol
        )

    def test_state_names_the_expert(self, policy, model_keys):
        state = policy.trainable_state_dict()
        assert {k.split(".", 1)[0] for k in state} == {"transformer", "transformer_2"}
        low_only = self.make_policy(model_keys, train_experts=["low_noise"])
        assert {k.split(".", 1)[0] for k in low_only.trainable_state_dict()} == {"transformer_2"}
        assert not any(
            "lora" in n for n, _ in low_only.pipeline.transformer.named_parameters()
        )  # the other stays the base
        assert low_only.trainable_module is low_only.trainable_module  # the experts' container
        assert {id(p) for p in low_only.trainable_module.parameters()} >= {
            id(p) for p in low_only.trainable_parameters()
        }

    @pytest.mark.parametrize(
        "experts, window_range, moved",
        [
            (None, [0, 2], {"transformer", "transformer_2"}),  # the window straddles the boundary: both train
            (None, [1, 3], {"transformer_2"}),  # the window lies below it: the high-noise expert gets no gradient
            (["high_noise"], [0, 2], {"transformer"}),  # the recipe trains one expert: the other has no adapter
        ],
        ids=["straddling-window", "low-noise-window", "high-noise-expert-only"],
    )
    def test_experts_train_per_the_recipe_and_the_window(self, model_keys, tmp_path, experts, window_range, moved):
        keys = {**model_keys, "train_experts": experts}
        sampler = {
            "name": "fast",
            "steps": 3,
            "window": 2,
            "window_range": window_range,
            "kernel": {"name": "sde", "eta": 0.7},
        }
        run, row, before = self.run_iteration(self.iteration_recipe(keys, tmp_path, sampler=sampler), tmp_path / "run")
        assert row["first_ratio_deviation"] <= 1e-6
        after = run.learner.policy.trainable_state_dict()

        def expert(key):
            return key.split(".", 1)[0] if key.startswith(("transformer.", "transformer_2.")) else "transformer"

        changed = {expert(k) for k in before if not torch.equal(before[k], after[k])}
        assert changed == moved  # one expert alone keeps the plain one-transformer keys

    def test_full_fine_tuning(self, model_keys, tmp_path):
        policy = self.make_policy(model_keys, lora=None)
        experts = [policy.pipeline.transformer, policy.pipeline.transformer_2]
        assert {id(p) for p in policy.trainable_parameters()} == {id(p) for m in experts for p in m.parameters()}
        written = policy.export(str(tmp_path / "full"))
        assert {os.path.basename(os.path.dirname(f)) for f in written} == {"transformer", "transformer_2"}


class TestWan22TI2V(DiffusersBackboneConformance):
    """Wan 2.2 TI2V-5B text-to-video: one transformer, the 48-channel 16x VAE, per-token timesteps."""

    model_name = "wan"
    label = "wan (2.2 TI2V-5B)"
    build_pipeline = staticmethod(build_tiny_wan22_ti2v_pipeline)
    model_params = {"max_sequence_length": SEQ, "resolution": 64, "num_frames": 5, "guidance_scale": 1.0}
    guidance_key = "guidance_scale"
    reward = {"name": "jpeg-compressibility", "frame_stride": 2}

    def pipeline_kwargs(self, policy):
        return {**WAN_KWARGS, "height": 64, "width": 64}

    def test_layout(self, policy):
        assert policy.latent_shape == (48, 2, 4, 4) and not policy.is_moe
        t = policy._token_timesteps(policy.initial_noise(2), torch.tensor([0.5, 0.25]))
        assert t.shape == (2, 2 * 2 * 2) and torch.all(t[0] == 500) and torch.all(t[1] == 250)


class TestWan22ImageToVideo(DiffusersBackboneConformance):
    """Wan 2.2 I2V-A14B's structure: two experts (boundary 0.9), the source image through the VAE."""

    model_name = "wan-i2v"
    label = "wan-i2v (2.2 I2V-A14B)"
    build_pipeline = staticmethod(build_tiny_wan22_i2v_pipeline)
    model_params = {"max_sequence_length": SEQ, "resolution": 32, "num_frames": 5, "guidance_scale": 1.0}
    guidance_key = "guidance_scale"
    reward = {"name": "jpeg-compressibility", "frame_stride": 2}

    @pytest.fixture(scope="class")
    @classmethod
    def images(cls, tmp_path_factory):
        """One source image per prompt, in a Flow-Factory-style dataset folder (images/ + train.jsonl)."""
        import json

        import numpy as np
        from PIL import Image

        folder = tmp_path_factory.mktemp("i2v-data")
        (folder / "images").mkdir()
        rows = []
        for i, prompt in enumerate((*cls.prompts, "something new")):  # the prompt cache's check encodes a third one
            pixels = (np.random.default_rng(i).random((32, 32, 3)) * 255).astype("uint8")
            Image.fromarray(pixels).save(folder / "images" / f"{i}.png")
            rows.append({"prompt": prompt, "image": f"{i}.png"})
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return folder

    def make_policy(self, model_keys, **overrides):
        from fgrpo.core.prompts import read_prompt_file

        policy = super().make_policy(model_keys, **overrides)
        # by text: these checks encode the plain prompts; the trainer's come from the folder with their images
        metadata = {str.__str__(p): m for p, m in read_prompt_file(self._folder / "train.jsonl")}
        policy.use_prompt_metadata(lambda p: metadata.get(str.__str__(p), {}))
        return policy

    @pytest.fixture(autouse=True)
    def _dataset(self, images):
        type(self)._folder = images

    def prompt_source(self, tmp_path):
        import shutil

        shutil.copytree(self._folder, tmp_path / "data")
        (tmp_path / "data" / "train.jsonl").write_text(
            "".join((tmp_path / "data" / "train.jsonl").read_text().splitlines(True)[:2])
        )
        return {"name": "folder", "path": str(tmp_path / "data"), "test": None}

    def pipeline_kwargs(self, policy):
        return dict(WAN_KWARGS)

    def load_export(self, pipe, folder, written):
        TestWan22.load_export(self, pipe, folder, written)

    def run_pipeline(self, policy, pipe, x, *, output_type="latent", steps=None):
        """The pipeline conditions a whole batch on one image: run it row by row, each with its prompt's image."""
        from PIL import Image

        from fgrpo.core.prompts import read_prompt_file

        images = {str.__str__(p): m["image"] for p, m in read_prompt_file(self._folder / "train.jsonl")}
        kwargs = {**self.pipeline_kwargs(policy), **self.guidance_kwargs(policy)}
        if policy.cfg:
            kwargs["negative_prompt"] = [policy.negative_prompt]
        rows = []
        for i in range(len(x)):
            prompt = self.prompts[i % len(self.prompts)]
            out = pipe(
                prompt=[prompt],
                image=Image.open(images[prompt]).convert("RGB"),
                latents=x[i : i + 1].clone(),
                num_inference_steps=steps or self.steps,
                output_type=output_type,
                **kwargs,
            )[0]
            rows.append(out)
        return torch.cat(rows) if output_type == "latent" else torch.cat(rows)

    def test_prompts_without_an_image_are_refused(self, policy):
        problems = policy.check_prompts(["a prompt the dataset does not have"])
        assert problems and "names no source image" in problems[0]

    def test_the_image_conditions_the_velocity(self, policy):
        cond = self.cond(policy)
        assert cond["image_latents"].shape == (2, 16, 2, 4, 4) and "negative_image_latents" not in cond
        x, sigma = self.state(policy)
        swapped = {**cond, "image_latents": cond["image_latents"].flip(0)}
        assert not torch.allclose(policy.velocity(x, sigma, cond), policy.velocity(x, sigma, swapped))

    def test_full_fine_tuning(self, model_keys, tmp_path):
        TestWan22.test_full_fine_tuning(self, model_keys, tmp_path)
