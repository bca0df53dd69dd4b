"""``DiffusersBackboneConformance``: :class:`~fgrpo.core.testing.PolicyConformance` plus what a
diffusers backbone owes its users, on a tiny random pipeline saved and loaded like real weights::

    from fgrpo.models.testing import DiffusersBackboneConformance, build_tiny_flux_pipeline

    class TestFlux(DiffusersBackboneConformance):
        model_name = "flux"
        build_pipeline = staticmethod(build_tiny_flux_pipeline)
        model_params = {"resolution": 64, "max_sequence_length": 16}
        guidance_key = "true_cfg_scale"                  # the recipe key of classifier-free guidance
        reward = {"name": "jpeg-compressibility"}

        def pipeline_kwargs(self, policy):               # what pipe(...) needs to match the policy
            return {"height": 64, "width": 64, "max_sequence_length": 16}

Added checks: our Euler loop over ``sigmas(steps)`` with our ``velocity`` reproduces ``pipe(...,
output_type="latent")`` (with and without guidance); ``decode`` is the pipeline's decoding; the
exported adapter loads into the plain pipeline with diffusers' ``load_lora_weights`` and gives the
same velocity (and back through ``lora_path``); the trainer iteration runs under bf16 autocast and
stays on-policy; the prompt cache encodes each prompt once; bf16 weights keep float32 LoRA weights,
velocities and gradients; gradient checkpointing leaves gradients unchanged; full fine-tuning trains
the whole transformer and exports it with ``save_pretrained``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from fgrpo.core import media
from fgrpo.core.testing.policies import PolicyConformance

#: set to a file path: every pipeline comparison appends its largest error there as a JSON line
#: ({"model", "check", "max_abs_error", "atol"}), which ``tools/conformance_errors.py`` tabulates
ERRORS_ENV = "FGRPO_CONFORMANCE_ERRORS"


def assert_matches(model: str, check: str, actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    """``assert_close(actual, expected, rtol=0, atol=atol)``, recording the largest error (ERRORS_ENV)."""
    path = os.environ.get(ERRORS_ENV)
    if path:
        import json

        error = float((actual.float() - expected.float()).abs().max())
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"model": model, "check": check, "max_abs_error": error, "atol": atol}) + "\n")
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


class DiffusersBackboneConformance(PolicyConformance):
    """Subclass, set ``model_name``, ``build_pipeline``, ``model_params``, ``guidance_key``,
    ``reward`` and implement ``pipeline_kwargs``."""

    #: a builder of a tiny pipeline: ``build_pipeline(path)`` saves it there
    build_pipeline: ClassVar[Callable[..., Any] | None] = None
    #: the recipe key of classifier-free guidance and a value > 1 for the guided checks
    guidance_key: ClassVar[str] = "guidance_scale"
    guidance_value: ClassVar[float] = 3.0
    #: recipe keys of the instance under test besides ``path`` and ``device``
    model_params: ClassVar[dict[str, Any]] = {}
    #: LoRA of the instance under test (small)
    lora: ClassVar[dict[str, Any]] = {"rank": 4}
    #: tolerance of our Euler loop against the pipeline's own output
    pipeline_atol: ClassVar[float] = 1e-4
    steps: ClassVar[int] = 3
    #: the trainer iteration runs under bf16 autocast: on-policy all the same
    mixed_precision: ClassVar[str] = "bf16"
    #: the backbone's name in FGRPO_CONFORMANCE_ERRORS records (default: model_name; e.g. a variant)
    label: ClassVar[str] = ""
    #: whether ``pipe(...)`` takes ``negative_prompt`` (FLUX.2 [klein]'s is always the empty prompt)
    pipeline_takes_negative_prompt: ClassVar[bool] = True

    def pipeline_kwargs(self, policy: Any) -> dict[str, Any]:
        """Keyword arguments that make ``pipe(...)`` generate what ``policy`` does (size, frames,
        sequence length)."""
        raise NotImplementedError

    def source_kwargs(self, policy: Any, prompts: list[str]) -> dict[str, Any]:
        """The pipeline's arguments for these prompts' source images (editing backbones: ``image``
        as the pipeline takes it); none by default."""
        return {}

    def load_export(self, pipe: Any, folder: str, written: list[str]) -> None:
        """Load ``policy.export(folder)``'s files into the plain pipeline ``pipe`` as a user would
        (default: ``pipe.load_lora_weights(folder)``; Wan 2.2 loads its second expert's file too)."""
        assert sorted(os.path.basename(f) for f in written) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "pytorch_lora_weights.safetensors",
        ]
        pipe.load_lora_weights(folder)

    def guidance_kwargs(self, policy: Any) -> dict[str, Any]:
        """The pipeline's guidance arguments for ``policy``'s settings (default: the same key)."""
        return {self.guidance_key: getattr(policy, self.guidance_key)}

    # --- fixtures -------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def pretrained_path(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        if cls.build_pipeline is None:
            pytest.fail(f"{cls.__name__} sets no build_pipeline")
        path = tmp_path_factory.mktemp(f"tiny-{cls.model_name}")
        cls.build_pipeline(path)
        return str(path)

    @pytest.fixture(scope="class")
    @classmethod
    def model_keys(cls, pretrained_path: str) -> dict[str, Any]:
        return {"path": pretrained_path, "device": "cpu", "lora": dict(cls.lora), **cls.model_params}

    # --- helpers --------------------------------------------------------------------------------

    def run_pipeline(
        self, policy: Any, pipe: Any, x: torch.Tensor, *, output_type: str = "latent", steps: int | None = None
    ) -> Any:
        prompts = [self.prompts[i % len(self.prompts)] for i in range(len(x))]
        kwargs = {
            **self.pipeline_kwargs(policy),
            **self.guidance_kwargs(policy),
            **self.source_kwargs(policy, prompts),
        }
        if policy.cfg and self.pipeline_takes_negative_prompt:
            kwargs["negative_prompt"] = [policy.negative_prompt] * len(x)
        out = pipe(
            prompt=[media.text_of(p) for p in prompts],
            latents=policy.to_pipeline_latents(x.clone()),
            num_inference_steps=steps or self.steps,
            output_type=output_type,
            **kwargs,
        )
        result = out[0]
        return policy.from_pipeline_latents(result) if output_type == "latent" else result

    # --- the checks -----------------------------------------------------------------------------

    @pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
    @torch.no_grad()
    def test_euler_loop_reproduces_the_pipeline(self, model_keys: dict[str, Any], guided: bool) -> None:
        """x' = x + (sigma' - sigma) v over sigmas(steps) equals pipe(output_type="latent"): the
        velocity's sign, timestep scaling, guidance, packing and the schedule are the pipeline's."""
        torch.manual_seed(0)
        keys = {**model_keys, "lora": {**self.lora, "init": "random"}}  # the adapter takes part
        if guided:
            keys[self.guidance_key] = self.guidance_value
        policy = self.make_policy(keys)
        assert policy.cfg == guided and policy.evaluations_per_call == (2 if guided else 1)
        x = policy.initial_noise(2, torch.Generator().manual_seed(3))
        start = x.clone()
        sigmas = policy.sigmas(self.steps)
        cond = self.cond(policy)
        for i in range(self.steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * policy.velocity(x, sigmas[i].expand(len(x)), cond)
        reference = self.run_pipeline(policy, policy.pipeline, start)
        check = "euler loop vs pipeline, " + ("guidance" if guided else "no guidance")
        assert_matches(self.label or self.model_name, check, x, reference.float(), self.pipeline_atol)

    @torch.no_grad()
    def test_decode_is_the_pipelines(self, policy: Any) -> None:
        x = policy.initial_noise(2, torch.Generator().manual_seed(4))
        latents = self.run_pipeline(policy, policy.pipeline, x, steps=2)
        pixels = self.run_pipeline(policy, policy.pipeline, x, output_type="pt", steps=2)
        assert_matches(
            self.label or self.model_name, "decode vs pipeline", policy.decode(latents), pixels.float(), 1e-5
        )

    @torch.no_grad()
    def test_export_loads_with_diffusers_load_lora_weights(
        self, policy: Any, model_keys: dict[str, Any], tmp_path: Path
    ) -> None:
        """The exported adapter, loaded by the plain pipeline's ``load_lora_weights`` or by peft's
        ``PeftModel.from_pretrained`` (the same folder), gives the policy's velocity (keys, rank
        and alpha all understood), and loads back via ``lora_path``."""
        from peft import PeftModel
        from safetensors import safe_open

        x, sigma = self.state(policy)
        cond = self.cond(policy)
        with policy.reference():
            base = policy.velocity(x, sigma, cond)
        with self.perturbed(policy):
            trained = policy.velocity(x, sigma, cond)
            written = policy.export(str(tmp_path / "lora"))
        # ten times the tolerance the reloaded velocity is compared at below: a no-op load cannot pass
        assert (trained - base).abs().max() > 1e-4, "the exported adapter does not change the velocity"
        for file in (f for f in written if os.path.basename(f).startswith("pytorch_lora_weights")):
            with safe_open(file, "pt") as f:
                keys, metadata = list(f.keys()), f.metadata() or {}
            assert keys and all(k.startswith("transformer.") for k in keys), keys[:3]
            assert any("lora_adapter_metadata" in k for k in metadata), metadata.keys()

        plain = type(policy).pipeline_class().from_pretrained(model_keys["path"])
        self.load_export(plain, str(tmp_path / "lora"), written)
        reloaded = type(policy).from_pipeline(plain, **{**model_keys, "lora": None})
        assert_matches(
            self.label or self.model_name,
            "exported LoRA in the plain pipeline",
            reloaded.velocity(x, sigma, cond),
            trained,
            1e-5,
        )

        again = self.make_policy(model_keys, lora_path=str(tmp_path / "lora"))
        torch.testing.assert_close(again.velocity(x, sigma, cond), trained, rtol=0, atol=1e-6)

        by_peft = type(policy).pipeline_class().from_pretrained(model_keys["path"])
        PeftModel.from_pretrained(by_peft.transformer, str(tmp_path / "lora"))  # adds the adapter to this transformer
        if (tmp_path / "lora" / "transformer_2" / "adapter_config.json").is_file():  # Wan 2.2's second expert
            PeftModel.from_pretrained(by_peft.transformer_2, str(tmp_path / "lora" / "transformer_2"))
        through_peft = type(policy).from_pipeline(by_peft, **{**model_keys, "lora": None})
        assert torch.equal(through_peft.velocity(x, sigma, cond), reloaded.velocity(x, sigma, cond))

    def test_prompt_cache_encodes_each_prompt_once(self, model_keys: dict[str, Any]) -> None:
        a, b = self.prompts[:2]
        probe = self.make_policy(model_keys)
        negatives = len(
            set(probe._negative_prompts([a, b]))
        )  # 1, or one per prompt (Qwen-Image-Edit: with its images)
        size = 2 + negatives
        policy = self.make_policy(model_keys, **{self.guidance_key: self.guidance_value}, prompt_cache_size=size)
        first = policy.encode([a, b, a])
        assert policy.prompt_cache.encoded == size  # a, b and the negative prompt(s)
        again = policy.encode([b, a])
        assert policy.prompt_cache.encoded == size
        for key, value in again.items():
            assert torch.equal(value[0], first[key][1]), key
            assert not value.requires_grad
        assert any(k.startswith("negative_") for k in first)
        policy.encode([media.Prompt("something new", images=media.source_images(a))])  # its negative is a's
        assert (
            policy.prompt_cache.encoded == size + 1 and len(policy.prompt_cache) == size
        )  # bounded: least recently used out

    def test_bfloat16_weights_keep_float32_training(self, model_keys: dict[str, Any]) -> None:
        policy = self.make_policy(model_keys, dtype="bfloat16")
        assert policy.transformer.dtype == policy.pipeline.vae.dtype == torch.bfloat16
        params = list(policy.trainable_parameters())
        assert params and all(p.dtype == torch.float32 for p in params)  # LoRA kept in fp32
        x, sigma = self.state(policy)
        with self.perturbed(policy):
            v = policy.velocity(x, sigma, self.cond(policy))
            assert v.dtype == torch.float32 and torch.isfinite(v).all()
            v.square().mean().backward()
        grads = [p.grad for p in params if p.grad is not None]
        assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
        with torch.no_grad():
            outputs = policy.decode(x)
        assert outputs.dtype == torch.float32 and 0 <= outputs.min() and outputs.max() <= 1

    def test_gradient_checkpointing_gives_the_same_gradients(self, model_keys: dict[str, Any]) -> None:
        grads = []
        for checkpointing in (False, True):
            torch.manual_seed(0)
            policy = self.make_policy(
                model_keys, gradient_checkpointing=checkpointing, lora={**self.lora, "init": "random"}
            )
            policy.transformer.train()  # checkpointing only acts in training mode
            x, sigma = self.state(policy)
            policy.velocity(x, sigma, self.cond(policy)).square().mean().backward()
            grads.append([p.grad for p in policy.trainable_parameters()])
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    @pytest.mark.slow
    def test_fgrpo_check_is_exact(
        self, model_keys: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``fgrpo check`` on a recipe of this tiny pipeline, in float32: the first ratio is exactly 1
        (tolerance 0), through the CLI a user runs."""
        import json

        from fgrpo.core import cli

        data = self.iteration_recipe(model_keys, tmp_path)
        data["train"] = {**data["train"], "mixed_precision": "no"}
        recipe = tmp_path / "check.yaml"
        recipe.write_text(json.dumps(data))  # JSON is YAML
        code = cli.main(["check", str(recipe), "--tolerance", "0"])
        printed = capsys.readouterr().out
        assert code == 0 and "on-policy check passed" in printed, printed
        path = os.environ.get(ERRORS_ENV)
        if path:
            import re

            found = re.search(r"largest \|ratio - 1\| before the first optimizer step: (\S+)", printed)
            assert found is not None, printed
            with open(path, "a", encoding="utf-8") as f:
                f.write(
                    json.dumps(
                        {
                            "model": self.label or self.model_name,
                            "check": "fgrpo check |ratio - 1|",
                            "max_abs_error": float(found.group(1)),
                            "atol": 0.0,
                        }
                    )
                    + "\n"
                )

    def test_full_fine_tuning(self, model_keys: dict[str, Any], tmp_path: Path) -> None:
        policy = self.make_policy(model_keys, lora=None)
        params = list(policy.trainable_parameters())
        assert {id(p) for p in params} == {id(p) for p in policy.transformer.parameters()}
        assert all(p.requires_grad for p in params)
        assert not any(p.requires_grad for m in policy.text_encoders() + [policy.pipeline.vae] for p in m.parameters())
        assert set(policy.trainable_state_dict()) == set(policy.transformer.state_dict())
        assert not policy.export_in_checkpoints
        with pytest.raises(RuntimeError, match="full fine-tuning"):
            with policy.reference():
                pass
        policy.export(str(tmp_path / "full"))
        reloaded = type(policy.transformer).from_pretrained(str(tmp_path / "full" / "transformer"))
        for key, value in reloaded.state_dict().items():
            assert torch.equal(value, policy.transformer.state_dict()[key]), key


class EditingBackboneConformance(DiffusersBackboneConformance):
    """The conformance of an editing backbone (prompts with source images, ``source_kwargs``
    giving them to the pipeline), plus ``fgrpo check``'s on-policy check on a float32 recipe of the
    tiny pipeline with the prompts written as an editing dataset folder."""

    def test_fgrpo_check_is_exact(self, model_keys: dict[str, Any], tmp_path: Path) -> None:
        from fgrpo.core import recipe as recipe_mod
        from fgrpo.core.onpolicy import first_ratio_check

        data = self.iteration_recipe(model_keys, tmp_path)
        data["train"] = {**data["train"], "mixed_precision": "no"}
        recipe, errors = recipe_mod.validate(data)
        assert recipe is not None and not errors, errors
        deviation, _ = first_ratio_check(recipe)
        assert deviation == 0.0


__all__ = ["DiffusersBackboneConformance", "EditingBackboneConformance"]
