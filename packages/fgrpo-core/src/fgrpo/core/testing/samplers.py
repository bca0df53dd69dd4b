"""``SamplerConformance``: the tests every group sampler (``fgrpo.samplers`` entry point) passes.

A sampler's test module subclasses it, names the sampler (or gives its class) and the recipe keys
of a small instance; the checks roll out on :class:`~fgrpo.core.testing.GaussianPolicy`::

    from fgrpo.core.testing import SamplerConformance

    class TestMySampler(SamplerConformance):
        sampler_name = "my-sampler"                  # the entry-point name (or sampler_class = MySampler)
        sampler_params = {"steps": 6, "kernel": "sde"}

What is checked: the entry point and every recipe key's help line; the ``Sampler`` protocol with a
stochastic kernel; a bad key refused with ``RecipeError``; the ``Trajectory``'s shapes and dtypes
(B = prompts x group samples, S trained steps, float32), prompts repeated per group and encoded
once, batch-first conditioning, positive stds, consecutive trained steps chaining; the stored
log-probs, means and stds re-evaluated bit-identically by the kernel (the update's first ratio is
1); the same generator seed gives the same rollout and another seed another; NFE counts every
velocity call (classifier-free guidance included); the state is plain JSON and a sampler restored
from it rolls out and moves on exactly as the original (resume).

A deterministic sampler (``transitions = False``, the rollouts of the objectives that train on the
forward process) is checked in its terms: a deterministic kernel, no trained steps (S = 0, nothing
stored but the final samples and their conditioning), and a final sample equal to the kernel's
steps run by hand from the same initial noise.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest
import torch

from fgrpo.core.config import RecipeError
from fgrpo.core.protocols import Sampler, Trajectory
from fgrpo.core.testing import _component
from fgrpo.core.testing.toys import GaussianPolicy


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class SamplerConformance:
    """Subclass, set ``sampler_name`` (or ``sampler_class``) and ``sampler_params``; pytest
    collects the subclasses (``Test...``)."""

    #: the sampler's entry-point name in the ``fgrpo.samplers`` group
    sampler_name: ClassVar[str] = ""
    #: or the sampler class itself (a sampler that is not installed, e.g. defined in a test)
    sampler_class: ClassVar[type | None] = None
    #: recipe keys of the instance under test
    sampler_params: ClassVar[dict[str, Any]] = {}
    #: keys that must be refused with ``RecipeError`` (an unknown key works for any sampler)
    bad_params: ClassVar[dict[str, Any]] = {"no_such_key": 1}
    #: the prompts of every rollout (distinct) and the group size
    prompts: ClassVar[tuple[str, ...]] = ("a red circle", "a blue square")
    group_size: ClassVar[int] = 3
    #: sample shapes the checks roll out on (no batch dimension)
    shapes: ClassVar[tuple[tuple[int, ...], ...]] = ((4,), (2, 4, 4))
    #: iterations the state checks advance to
    iterations: ClassVar[tuple[int, ...]] = (0, 1, 7, 60)
    #: whether ``trajectory.info["nfe"]`` splits the NFE by phase (samplers built on GroupSampler do)
    nfe_by_phase: ClassVar[bool] = True

    # --- hooks ----------------------------------------------------------------------------------

    def make_sampler(self, **overrides: Any) -> Any:
        params = {**self.sampler_params, **overrides}
        return _component.build("sampler", self.sampler_name, self.sampler_class, params)

    def make_policy(self, **options: Any) -> GaussianPolicy:
        return GaussianPolicy(**options)

    def rollout(self, sampler: Any, policy: Any, seed: int = 0) -> Trajectory:
        traj = sampler.rollout(policy, list(self.prompts), self.group_size, generator=gen(seed))
        assert isinstance(traj, Trajectory), f"rollout returned {type(traj).__name__}, expected a Trajectory"
        return traj

    @property
    def batch(self) -> int:
        return len(self.prompts) * self.group_size

    # --- construction ---------------------------------------------------------------------------

    def test_registered_with_documented_keys(self) -> None:
        _component.check_registered_and_documented("sampler", self.sampler_name, self.sampler_class, docstring=True)

    @property
    def transitions(self) -> bool:
        """Whether the sampler's rollouts record trained stochastic transitions."""
        return bool(getattr(self.make_sampler(), "transitions", True))

    def test_satisfies_protocol(self) -> None:
        sampler = self.make_sampler()
        assert isinstance(sampler, Sampler)
        if self.transitions:
            assert getattr(sampler.kernel, "stochastic", False), (
                "a sampler trains its kernel's steps: a stochastic one"
            )
        else:
            assert not getattr(sampler.kernel, "stochastic", False), (
                "a sampler without transitions takes deterministic steps"
            )

    def test_bad_params_raise_recipe_error(self) -> None:
        with pytest.raises(RecipeError):
            self.make_sampler(**self.bad_params)

    # --- the trajectory -------------------------------------------------------------------------

    def test_trajectory_shapes_and_dtypes(self) -> None:
        for shape in self.shapes:
            self.check_trajectory(shape)

    def check_trajectory(self, shape: tuple[int, ...]) -> None:
        policy = self.make_policy(shape=shape)
        sampler = self.make_sampler()
        traj = self.rollout(sampler, policy)
        batch, s = self.batch, traj.num_trained_steps
        if self.transitions:
            assert s >= 1, "a rollout trains at least one step"
        else:
            assert s == 0, "a deterministic rollout stores no trained steps"
        assert traj.prompts == [p for p in self.prompts for _ in range(self.group_size)]
        assert traj.group_index.tolist() == [i for i in range(len(self.prompts)) for _ in range(self.group_size)]
        assert traj.step_index.shape == (batch, s) and traj.step_index.dtype == torch.long
        for t in (traj.latents, traj.next_latents, traj.means):
            assert t.shape == (batch, s, *shape) and t.dtype == torch.float32
        for t in (traj.log_probs, traj.stds):
            assert t.shape == (batch, s) and t.dtype == torch.float32
        assert (traj.stds > 0).all(), "a trained step has std 0"
        assert traj.final.shape == (batch, *shape) and traj.final.dtype == torch.float32
        steps = getattr(sampler, "steps", None)
        if steps is not None:
            assert traj.sigmas.shape == (steps + 1,)
        if s:
            assert int(traj.step_index.max()) < traj.sigmas.shape[0] - 1
        assert traj.cond["mean"].shape == (batch, *shape), "the conditioning is repeated per sample, batch-first"
        assert traj.cond["length"].tolist() == [len(p) for p in traj.prompts]
        assert policy.encoded == list(self.prompts), "every prompt is encoded once, then repeated"
        # consecutive trained steps chain: the action of step j is the state of step j + 1
        chained = traj.step_index[:, 1:] == traj.step_index[:, :-1] + 1
        assert torch.equal(traj.next_latents[:, :-1][chained], traj.latents[:, 1:][chained])

    def test_log_probs_re_evaluate_bit_identically(self) -> None:
        """The update re-runs the network on the stored (x, sigma) and keeps the stored x' fixed."""
        policy = self.make_policy(shape=self.shapes[-1])
        sampler = self.make_sampler()
        traj = self.rollout(sampler, policy, seed=3)
        for j in range(traj.num_trained_steps):
            index = traj.step_index[:, j]
            x = traj.latents[:, j]
            v = policy.velocity(x, traj.sigmas[index], traj.cond)
            again = sampler.kernel.step(v, x, traj.sigmas, index, prev_sample=traj.next_latents[:, j])
            assert torch.equal(again.log_prob, traj.log_probs[:, j])
            assert torch.equal(again.mean, traj.means[:, j])
            assert torch.equal(again.std.reshape(self.batch, -1)[:, 0], traj.stds[:, j])

    def test_deterministic_rollout_is_its_kernel_run_by_hand(self) -> None:
        """A sampler without transitions: the final sample is the kernel's steps from the noise."""
        if self.transitions:
            pytest.skip("the sampler records transitions")
        policy = self.make_policy(shape=self.shapes[-1])
        sampler = self.make_sampler()
        traj = self.rollout(sampler, policy, seed=5)
        if getattr(sampler, "share_noise", False):  # one draw per prompt, repeated for its group
            x = policy.initial_noise(len(self.prompts), gen(5)).float().repeat_interleave(self.group_size, dim=0)
        else:
            x = policy.initial_noise(self.batch, gen(5)).float()
        if hasattr(sampler.kernel, "reset"):
            sampler.kernel.reset()
        for i in range(traj.sigmas.shape[0] - 1):
            v = policy.velocity(x, traj.sigmas[i].expand(self.batch), traj.cond)
            x = sampler.kernel.step(v, x, traj.sigmas, i).prev_sample.float()
        torch.testing.assert_close(traj.final, x, rtol=0, atol=1e-6)

    def test_same_seed_same_rollout(self) -> None:
        policy = self.make_policy()
        a = self.rollout(self.make_sampler(), policy, seed=7)
        b = self.rollout(self.make_sampler(), policy, seed=7)
        c = self.rollout(self.make_sampler(), policy, seed=8)
        assert torch.equal(a.final, b.final) and torch.equal(a.log_probs, b.log_probs)
        assert not torch.equal(a.final, c.final)

    @pytest.mark.parametrize("guidance", [None, 4.5], ids=["no-cfg", "cfg"])
    def test_nfe_counts_every_velocity_call(self, guidance: float | None) -> None:
        policy = self.make_policy(guidance=guidance)
        traj = self.rollout(self.make_sampler(), policy)
        assert traj.nfe == sum(policy.rows) * policy.evaluations_per_call
        if self.nfe_by_phase:
            assert sum(traj.info["nfe"].values()) == traj.nfe
            assert traj.info["nfe_per_sample"] == pytest.approx(traj.nfe / self.batch)

    # --- state (resume) -------------------------------------------------------------------------

    def test_state_round_trip(self) -> None:
        """``advance(it)``, then the state through JSON (checkpoints store it so) into a new sampler:
        both roll out the same and move on the same."""
        policy = self.make_policy()
        for it in self.iterations:
            original = self.make_sampler()
            original.advance(it)
            state = json.loads(json.dumps(original.state_dict()))
            restored = self.make_sampler()
            restored.load_state_dict(state)
            a, b = self.rollout(original, policy, seed=it), self.rollout(restored, policy, seed=it)
            assert torch.equal(a.final, b.final) and torch.equal(a.step_index, b.step_index), f"iteration {it}"
            original.advance(it + 1)
            restored.advance(it + 1)
            assert original.state_dict() == restored.state_dict(), f"after iteration {it + 1}"


__all__ = ["SamplerConformance"]
