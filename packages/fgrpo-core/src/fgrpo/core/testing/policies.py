"""``PolicyConformance``: the tests every backbone (``fgrpo.models`` entry point) passes.

A backbone's test module subclasses it, names the backbone and the recipe keys of a small
instance, and a reward the trainer iteration can score its outputs with::

    from fgrpo.core.testing import PolicyConformance

    class TestMyBackbone(PolicyConformance):
        model_name = "my-backbone"                       # the entry-point name
        model_params = {"path": "tiny/folder", "device": "cpu", "lora": {"rank": 4}}
        reward = {"name": "jpeg-compressibility"}        # scores this backbone's outputs

Backbones whose keys are only known at test time (a tiny model saved to a temporary folder)
override the class-scoped ``model_keys`` fixture instead of ``model_params``.

What is checked: the entry point and every recipe key's help line; the ``Policy`` protocol;
shapes and float32 dtypes of noise, schedule, velocity and outputs; ``cond`` is batch-first
(each leaf indexed along dimension 0 gives the same velocity for that row: no non-batch tensor
travels in it); encoding is per prompt; ``reference()`` is the base model exactly (velocity
before training), nests, and restores the trained weights exactly; the trainable state
round-trips exactly and a wrong state is refused; gradients reach every trainable parameter;
one trainer iteration end to end, through the registry, on-policy (first ratio 1) and with a
checkpoint (holding the policy's ``export`` files when it declares ``export_in_checkpoints``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from fgrpo.core import media, registry, tensors
from fgrpo.core.config import help_lines
from fgrpo.core.protocols import Policy

#: policies built by the ``policy`` fixture, one per test class (built once, shared by its tests)
_BUILT: dict[type, Any] = {}


class PolicyConformance:
    """Subclass, set ``model_name``, ``model_params`` (or the ``model_keys`` fixture) and
    ``reward``; pytest collects the subclasses (``Test...``)."""

    #: the backbone's entry-point name in the ``fgrpo.models`` group
    model_name: ClassVar[str] = ""
    #: recipe keys of the instance under test (small: these tests build it several times)
    model_params: ClassVar[dict[str, Any]] = {}
    #: prompts the checks encode (at least 2, distinct)
    prompts: ClassVar[tuple[str, ...]] = ("a red circle", "two blue squares")
    #: the reward spec of the trainer iteration (a registered name or a mapping); required
    reward: ClassVar[Any] = None
    #: the sampler spec of the trainer iteration
    sampler: ClassVar[Any] = {"name": "full", "steps": 2, "kernel": {"name": "sde", "eta": 0.7}}
    #: whether ``decode`` gives outputs in [0, 1] (images, videos); vectors need not
    outputs_in_unit_range: ClassVar[bool] = True
    #: whether ``reference()`` exists (False: full fine-tuning without a frozen copy)
    has_reference: ClassVar[bool] = True
    #: tolerance of "same velocity" between a row alone and the row in a batch
    batch_atol: ClassVar[float] = 1e-5
    #: ``train.mixed_precision`` of the trainer iteration (bf16: autocast, still on-policy)
    mixed_precision: ClassVar[str] = "auto"

    # --- building -------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def model_keys(cls) -> dict[str, Any]:
        """The recipe keys (without ``name``) the policy is built from."""
        return dict(cls.model_params)

    def make_policy(self, model_keys: Mapping[str, Any], **overrides: Any) -> Any:
        return registry.create("model", self.model_name, **{**dict(model_keys), **overrides})

    @pytest.fixture
    def policy(self, model_keys: dict[str, Any]) -> Any:
        """The policy, built once per test class and shared: tests that change its trainable
        weights restore them (:meth:`perturbed`)."""
        if not self.model_name:
            pytest.fail(f"{type(self).__name__} sets no model_name")
        cls = type(self)
        if cls not in _BUILT:
            torch.manual_seed(0)
            _BUILT[cls] = self.make_policy(model_keys)
        return _BUILT[cls]

    # --- helpers --------------------------------------------------------------------------------

    @staticmethod
    def state(policy: Any, n: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, sigma): noised states at a mid-trajectory noise level, and that level per row."""
        x = policy.initial_noise(n, torch.Generator(device=policy.device).manual_seed(seed))
        sigmas = policy.sigmas(4)
        return x, sigmas[1].expand(n).clone()

    def cond(self, policy: Any, n: int = 2) -> Any:
        return policy.encode([self.prompts[i % len(self.prompts)] for i in range(n)])

    @contextmanager
    def perturbed(self, policy: Any, scale: float = 0.05, seed: int = 0) -> Iterator[None]:
        """Random trainable weights inside (so a LoRA changes the outputs), exactly restored after."""
        saved = policy.trainable_state_dict()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in policy.trainable_parameters():
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.device, p.dtype))
        try:
            yield
        finally:
            policy.load_trainable_state_dict(saved)

    # --- the checks -----------------------------------------------------------------------------

    def test_registered_with_documented_keys(self) -> None:
        assert self.model_name in registry.names("model"), (
            f"{self.model_name!r} is not in the fgrpo.models entry points: {registry.names('model')}"
        )
        cls = registry.load("model", self.model_name)
        assert (cls.__doc__ or "").strip(), "the policy class needs a docstring"
        for key, _default, help_text in help_lines(cls):
            assert help_text, f"recipe key {key!r} has no help line"

    def test_satisfies_protocol(self, policy: Any) -> None:
        assert isinstance(policy, Policy)
        assert isinstance(policy.device, torch.device)
        assert isinstance(policy.evaluations_per_call, int) and policy.evaluations_per_call >= 1

    def test_noise_and_schedule(self, policy: Any) -> None:
        a = policy.initial_noise(3, torch.Generator(device=policy.device).manual_seed(1))
        b = policy.initial_noise(3, torch.Generator(device=policy.device).manual_seed(1))
        assert a.dtype == torch.float32 and a.device.type == policy.device.type and a.shape[0] == 3
        assert torch.equal(a, b), "the same generator seed must give the same noise"
        for steps in (2, 5):
            sigmas = policy.sigmas(steps)
            assert sigmas.shape == (steps + 1,) and sigmas.dtype == torch.float32
            assert torch.all(sigmas[1:] < sigmas[:-1]), f"sigmas must decrease: {sigmas}"
            assert float(sigmas[0]) <= 1.0 and float(sigmas[-1]) == 0.0

    @torch.no_grad()
    def test_velocity_and_outputs(self, policy: Any) -> None:
        x, sigma = self.state(policy)
        v = policy.velocity(x, sigma, self.cond(policy))
        assert v.shape == x.shape, f"velocity shape {tuple(v.shape)}, state {tuple(x.shape)}"
        assert v.dtype == torch.float32 and torch.isfinite(v).all()
        outputs = policy.decode(x)
        assert isinstance(outputs, torch.Tensor) and outputs.shape[0] == x.shape[0]
        assert outputs.dtype == torch.float32 and torch.isfinite(outputs).all()
        if self.outputs_in_unit_range:
            assert outputs.min() >= 0 and outputs.max() <= 1
            assert outputs.dim() in (4, 5) and outputs.shape[-3] == 3, (
                f"images are (B, 3, H, W) and videos (B, T, 3, H, W); got {tuple(outputs.shape)}"
            )

    @torch.no_grad()
    def test_cond_is_batch_first(self, policy: Any) -> None:
        """Every ``cond`` leaf has the batch first: one row alone gives that row's velocity, and a
        batch repeated per group (as the trainer does) matches row by row."""
        x, sigma = self.state(policy)
        cond = self.cond(policy)
        leaves = _leaves(cond)
        assert leaves, "encode() returned no tensors"
        for leaf in leaves:
            assert leaf.dim() >= 1 and leaf.shape[0] == 2, f"a cond tensor of shape {tuple(leaf.shape)} for 2 prompts"
        both = policy.velocity(x, sigma, cond)
        alone = policy.velocity(x[1:], sigma[1:], tensors.index(cond, slice(1, 2)))
        torch.testing.assert_close(alone, both[1:], rtol=0, atol=self.batch_atol)
        grouped = policy.velocity(
            x.repeat_interleave(2, 0), sigma.repeat_interleave(2), tensors.repeat_interleave(cond, 2)
        )
        torch.testing.assert_close(grouped[::2], both, rtol=0, atol=self.batch_atol)
        assert not torch.allclose(both[0], both[1]), "two prompts and two noises gave the same velocity"

    @torch.no_grad()
    def test_encode_is_per_prompt(self, policy: Any) -> None:
        a, b = self.prompts[:2]
        cond = policy.encode([a, b, a])
        tensors.tree_map(lambda t: _assert_rows_equal(t, 0, 2), cond)  # rows 0 and 2 encode the same prompt
        single = policy.encode([b])
        pair = tensors.index(cond, slice(1, 2))
        _assert_trees_close(single, pair, atol=self.batch_atol)

    @torch.no_grad()
    def test_reference_is_the_base_and_restores_the_trained_weights(self, policy: Any) -> None:
        if not self.has_reference:
            pytest.skip("full fine-tuning without a frozen reference")
        x, sigma = self.state(policy)
        cond = self.cond(policy)
        base = policy.velocity(x, sigma, cond)
        with self.perturbed(policy):
            trained = policy.velocity(x, sigma, cond)
            assert not torch.equal(trained, base), "changing the trainable weights did not change the velocity"
            with policy.reference():
                assert torch.equal(policy.velocity(x, sigma, cond), base), "reference() is not the base model"
                with policy.reference():
                    pass
                assert torch.equal(policy.velocity(x, sigma, cond), base), "a nested reference() ended the outer one"
            assert torch.equal(policy.velocity(x, sigma, cond), trained), (
                "leaving reference() did not restore the weights"
            )
        assert all(p.requires_grad for p in policy.trainable_parameters())

    @torch.no_grad()
    def test_trainable_state_round_trip(self, policy: Any) -> None:
        state = policy.trainable_state_dict()
        assert state and all(isinstance(v, torch.Tensor) for v in state.values())
        assert all(not v.requires_grad and v.device.type == "cpu" for v in state.values()), (
            "state must be detached CPU copies"
        )
        x, sigma = self.state(policy)
        cond = self.cond(policy)
        before = policy.velocity(x, sigma, cond)
        with self.perturbed(policy):
            assert not torch.equal(policy.velocity(x, sigma, cond), before)
            policy.load_trainable_state_dict(state)
            assert torch.equal(policy.velocity(x, sigma, cond), before)
        key = next(iter(state))
        with pytest.raises((ValueError, KeyError, RuntimeError)):
            policy.load_trainable_state_dict({k: v for k, v in state.items() if k != key})

    def test_gradients_reach_the_trainable_parameters(self, policy: Any) -> None:
        """Backward through ``velocity`` gives finite gradients of the parameters' dtypes to (at
        least most of) the trainable parameters. Some may get none: a network whose last block's
        text stream feeds nothing (Qwen-Image) leaves adapters there without gradient."""
        params = [p for p in policy.trainable_parameters() if p.requires_grad]
        assert params, "no trainable parameters"
        x, sigma = self.state(policy)
        with self.perturbed(policy):  # LoRA B starts at zero: A would get no gradient
            for p in params:
                p.grad = None
            policy.velocity(x, sigma, self.cond(policy)).square().mean().backward()
            try:
                reached = [p for p in params if p.grad is not None]
                assert len(reached) >= len(params) / 2, (
                    f"only {len(reached)} of {len(params)} trainable tensors got a gradient"
                )
                for p in reached:
                    assert torch.isfinite(p.grad).all() and p.grad.dtype == p.dtype
                assert any(p.grad.abs().sum() > 0 for p in reached)
            finally:
                for p in params:
                    p.grad = None

    def prompt_source(self, tmp_path: Path) -> dict[str, Any]:
        """The prompts spec of the trainer iteration: the ``prompts`` in the recipe, or, when they
        carry source images (an editing backbone), a dataset folder of them written under
        ``tmp_path`` (``train_metadata.jsonl`` with each image as a PNG beside it)."""
        if not any(media.source_images(p) for p in self.prompts):
            return {"name": "list", "train": list(self.prompts)}
        folder = tmp_path / "prompts"
        folder.mkdir(parents=True, exist_ok=True)
        rows = []
        for i, prompt in enumerate(self.prompts):
            names = []
            for k, ref in enumerate(media.source_images(prompt)):
                names.append(f"source_{i}_{k}.png")
                media.load_image(ref).save(folder / names[-1])
            rows.append(
                {
                    "prompt": media.text_of(prompt),
                    **({"image": names if len(names) > 1 else names[0]} if names else {}),
                }
            )
        (folder / "train_metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"name": "folder", "path": str(folder), "test": None}

    def iteration_recipe(self, model_keys: Mapping[str, Any], tmp_path: Path, **sections: Any) -> dict[str, Any]:
        """The recipe of one small trainer iteration; ``sections`` replace whole sections."""
        data = {
            "seed": 0,
            "model": {"name": self.model_name, **model_keys},
            "sampler": self.sampler,
            "reward": self.reward,
            "objective": {"name": "grpo", "clip_range": 1e-3, "kl_beta": 0.01 if self.has_reference else 0.0},
            "prompts": self.prompt_source(tmp_path),
            "train": {
                "iterations": 1,
                "group_size": 2,
                "prompts_per_iteration": 2,
                "lr": 1e-2,
                "drop_zero_advantage": False,
                "mixed_precision": self.mixed_precision,
            },
            "eval": {"every": 0},
            "log": {"trackers": [], "plots": False, "quiet": True, "sample_grid": False},
        }
        return {**data, **sections}

    def run_iteration(self, data: Mapping[str, Any], out: Path) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
        """Validate ``data``, open a run in ``out`` and train it: (run, its last metrics row, the
        trainable state before training)."""
        from rich.console import Console

        from fgrpo.core import recipe as recipe_mod
        from fgrpo.core.opening import open_run
        from fgrpo.core.trainer import train

        recipe, errors = recipe_mod.validate(dict(data), "conformance")
        assert recipe is not None and not errors, [str(e) for e in errors]
        run = open_run(recipe, out=str(out), resume=False, console=Console(quiet=True), quiet=True)
        before = {k: v.clone() for k, v in run.learner.policy.trainable_state_dict().items()}
        return run, train(run), before

    def test_one_trainer_iteration(self, model_keys: dict[str, Any], tmp_path: Path) -> None:
        """Build from a recipe through the registry, roll out, score, update, checkpoint: the first
        ratio is exactly 1 (on-policy) and the trainable weights move."""
        from fgrpo.core import checkpoint as ckpt

        if self.reward is None:
            pytest.fail(f"{type(self).__name__} sets no reward for the trainer iteration")
        run, row, before = self.run_iteration(self.iteration_recipe(model_keys, tmp_path), tmp_path / "run")
        assert row["first_ratio_deviation"] <= 1e-6, f"first ratio off by {row['first_ratio_deviation']}"
        for key in ("reward_mean", "policy_loss", "kl", "nfe_rollout", "nfe_train"):
            assert key in row and math.isfinite(row[key]), (key, row.get(key))
        after = run.learner.policy.trainable_state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), "one optimizer step changed no weight"
        last = ckpt.latest(tmp_path / "run" / "checkpoints")
        assert last is not None and (last / ckpt.TRAINABLE).is_file()
        if getattr(run.learner.policy, "export_in_checkpoints", False):
            exported = list((last / ckpt.EXPORT).iterdir())
            assert exported, f"the checkpoint's {ckpt.EXPORT}/ folder is empty"


def _assert_rows_equal(t: torch.Tensor, i: int, j: int) -> torch.Tensor:
    assert torch.equal(t[i], t[j]), "the same prompt encoded twice in one batch gave different rows"
    return t


def _leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) conditioning, in tree_map's order."""
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    tensors.tree_map(collect, tree)
    return found


def _assert_trees_close(a: Any, b: Any, atol: float) -> None:
    left, right = _leaves(a), _leaves(b)
    assert len(left) == len(right)
    for x, y in zip(left, right, strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=atol)


__all__ = ["PolicyConformance"]
