"""``ObjectiveConformance``: the tests every policy objective (``fgrpo.objectives`` entry point) passes.

An objective's test module subclasses it, names the objective (or gives its class) and its recipe
keys; the checks call it on random minibatches of one trained step::

    from fgrpo.core.testing import ObjectiveConformance

    class TestMyObjective(ObjectiveConformance):
        objective_name = "my-objective"              # the entry-point name (or objective_class = ...)
        objective_params = {"clip_range": 1e-3, "kl_beta": 0.04}

What is checked: the entry point and every recipe key's help line; the ``Objective`` protocol
(``needs_reference`` a bool); a bad key refused with ``RecipeError``; the loss is a finite scalar
with gradient, the metrics finite detached scalars; the same batch gives the same loss and a
reordered batch the same loss and metrics (samples are independent); on-policy (new log-probs equal
to the stored ones) the gradient raises the log-prob of every sample with a positive advantage and
lowers it for a negative one; an objective that asks for the reference uses it (moving the
reference moves the loss) and one that does not never reads it (the trainer computes none);
``check_recipe`` (optional) returns a list of errors.

Objectives that train on the forward process (``trains_on = "forward"``) get a
:class:`~fgrpo.core.protocols.ForwardBatch` instead, and the same checks in its terms: at θ = θ_old
(the old and the reference predictions equal the current one) descent moves each row's velocity
toward its flow-matching target when its advantage is positive and away from it when negative (a
pair's preferred row toward, its rejected row away); the old policy is used exactly when the
objective keeps one (``needs_old``), with a decay in [0, 1); ``point_times`` draws noise levels in
(0, 1] reproducibly from a generator; a pairwise objective's ``pairs`` pair samples of one group,
the preferred one with the higher advantage; the batch is reordered pair by pair.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import pytest
import torch

from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.protocols import ForwardBatch, Objective, ObjectiveOutput, StepBatch
from fgrpo.core.testing import _component


class ObjectiveConformance:
    """Subclass, set ``objective_name`` (or ``objective_class``) and ``objective_params``; pytest
    collects the subclasses (``Test...``)."""

    #: the objective's entry-point name in the ``fgrpo.objectives`` group
    objective_name: ClassVar[str] = ""
    #: or the objective class itself (an objective that is not installed, e.g. defined in a test)
    objective_class: ClassVar[type | None] = None
    #: recipe keys of the instance under test
    objective_params: ClassVar[dict[str, Any]] = {}
    #: keys that must be refused with ``RecipeError`` (an unknown key works for any objective)
    bad_params: ClassVar[dict[str, Any]] = {"no_such_key": 1}
    #: samples per minibatch and the shape of one sample
    batch_size: ClassVar[int] = 6
    shape: ClassVar[tuple[int, ...]] = (2, 3)
    #: tolerance of "the same loss" for a reordered batch (sums in another order)
    atol: ClassVar[float] = 1e-6

    # --- hooks ----------------------------------------------------------------------------------

    def make_objective(self, **overrides: Any) -> Any:
        params = {**self.objective_params, **overrides}
        return _component.build("objective", self.objective_name, self.objective_class, params)

    @property
    def forward(self) -> bool:
        target: Any = _component.component_class(
            "objective", self.objective_name, self.objective_class, "ObjectiveConformance"
        )
        return target.trains_on == "forward"

    def make_batch(self, *, seed: int = 0, on_policy: bool = True, reference: bool = True) -> StepBatch | ForwardBatch:
        if self.forward:
            return self.make_forward_batch(seed=seed, on_policy=on_policy, reference=reference)
        return self.make_step_batch(seed=seed, on_policy=on_policy, reference=reference)

    def make_forward_batch(
        self, *, seed: int = 0, on_policy: bool = True, reference: bool = True, old: bool = True
    ) -> ForwardBatch:
        """Forward-process points: advantages of both signs (none zero; a pairwise objective's rows
        are m preferred then m rejected, +1 and -1), t in [0.1, 0.9]; ``on_policy``: the old
        policy's prediction equals the current one (θ = θ_old). The velocity is a leaf with gradient."""
        g = torch.Generator().manual_seed(seed)
        b = self.batch_size

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=g)

        x0, noise = randn(b, *self.shape), randn(b, *self.shape)
        t = 0.1 + 0.8 * torch.rand(b, generator=g)
        tt = t.reshape(-1, *([1] * len(self.shape)))
        pairwise = self.make_objective().pairwise
        if pairwise:
            m = b // 2
            noise[m:], t[m:] = noise[:m], t[:m]
            tt = t.reshape(-1, *([1] * len(self.shape)))
            advantages = torch.cat([torch.ones(m), -torch.ones(b - m)])
        else:
            advantages = torch.tensor([(-1.0) ** i for i in range(b)]) * (0.2 + torch.rand(b, generator=g))
        velocity = (noise - x0) + 0.3 * randn(b, *self.shape)
        drift = 0.0 if on_policy else 1.0
        old_velocity = velocity + drift * 0.05 * randn(b, *self.shape)
        ref_velocity = velocity + 0.05 * randn(b, *self.shape)
        return ForwardBatch(
            advantages=advantages,
            t=t,
            x0=x0,
            noise=noise,
            x_t=(1 - tt) * x0 + tt * noise,
            velocity=velocity.clone().requires_grad_(True),
            old_velocity=old_velocity if old else None,
            ref_velocity=ref_velocity if reference else None,
        )

    def make_step_batch(self, *, seed: int = 0, on_policy: bool = True, reference: bool = True) -> StepBatch:
        """A minibatch of one trained step: advantages of both signs (none zero), positive stds,
        negative dts; ``on_policy``: the new log-probs and means equal the stored ones. The new
        log-prob, mean and velocity are leaves with gradient."""
        g = torch.Generator().manual_seed(seed)
        b = self.batch_size

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=g)

        old_log_prob, old_mean = randn(b), randn(b, *self.shape)
        drift = 0.0 if on_policy else 1.0
        velocity = randn(b, *self.shape)
        signs = torch.tensor([(-1.0) ** i for i in range(b)])
        return StepBatch(
            log_prob=(old_log_prob + drift * 0.01 * randn(b)).requires_grad_(True),
            old_log_prob=old_log_prob,
            advantages=signs * (0.2 + torch.rand(b, generator=g)),
            mean=(old_mean + drift * 0.01 * randn(b, *self.shape)).requires_grad_(True),
            old_mean=old_mean,
            std=0.1 + 0.4 * torch.rand(b, generator=g),
            dt=-(0.05 + 0.1 * torch.rand(b, generator=g)),
            velocity=velocity.requires_grad_(True),
            ref_mean=(old_mean + 0.05 * randn(b, *self.shape)) if reference else None,
            ref_velocity=(velocity.detach() + 0.05 * randn(b, *self.shape)) if reference else None,
        )

    def call(self, objective: Any, batch: StepBatch | ForwardBatch) -> ObjectiveOutput:
        out = objective(batch)
        assert isinstance(out, ObjectiveOutput), (
            f"the objective returned {type(out).__name__}, expected ObjectiveOutput"
        )
        return out

    # --- construction ---------------------------------------------------------------------------

    def test_registered_with_documented_keys(self) -> None:
        _component.check_registered_and_documented(
            "objective", self.objective_name, self.objective_class, docstring=True
        )

    def test_satisfies_protocol(self) -> None:
        """The typed members the update reads (fgrpo.core.objectives.base gives their defaults)."""
        objective = self.make_objective()
        assert isinstance(objective, Objective)
        assert objective.trains_on in ("transitions", "forward")
        flags = (objective.needs_reference, objective.needs_old, objective.samples_from_old, objective.pairwise)
        assert all(isinstance(flag, bool) for flag in flags), flags
        assert not objective.samples_from_old or objective.needs_old  # rollouts from an old policy it keeps
        assert objective.trains_on == "forward" or not (objective.needs_old or objective.pairwise)

    def test_bad_params_raise_recipe_error(self) -> None:
        with pytest.raises(RecipeError):
            self.make_objective(**self.bad_params)

    # --- the loss -------------------------------------------------------------------------------

    def test_loss_and_metrics(self) -> None:
        batch = self.make_batch(on_policy=False)
        out = self.call(self.make_objective(), batch)
        assert out.loss.ndim == 0 and out.loss.is_floating_point() and torch.isfinite(out.loss)
        assert out.loss.requires_grad, "the loss carries no gradient"
        for name, value in out.metrics.items():
            assert isinstance(value, torch.Tensor) and value.ndim == 0, f"metric {name!r} is not a 0-d tensor"
            assert not value.requires_grad, f"metric {name!r} is not detached"
            assert torch.isfinite(value), f"metric {name!r} = {value}"
        out.loss.backward()
        leaves = (batch.velocity,) if isinstance(batch, ForwardBatch) else (batch.log_prob, batch.mean, batch.velocity)
        grads = [t.grad for t in leaves if t is not None and t.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)

    def test_deterministic(self) -> None:
        objective = self.make_objective()
        a = self.call(objective, self.make_batch(seed=1, on_policy=False)).loss
        b = self.call(objective, self.make_batch(seed=1, on_policy=False)).loss
        assert torch.equal(a, b)

    def test_samples_are_independent(self) -> None:
        """A reordered minibatch gives the same loss and metrics."""
        objective = self.make_objective()
        batch = self.make_batch(seed=2, on_policy=False)
        order = torch.roll(torch.arange(self.batch_size), 1)
        if objective.pairwise:  # pair by pair: the preferred half and the rejected half alike
            m = self.batch_size // 2
            half = torch.roll(torch.arange(m), 1)
            order = torch.cat([half, half + m])
        kind = type(batch)
        fields: dict[str, Any] = {
            f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name).detach()[order]
            for f in attrs.fields(kind)
        }
        moved = kind(**fields)
        a, b = self.call(objective, batch), self.call(objective, moved)
        torch.testing.assert_close(b.loss, a.loss.detach(), atol=self.atol, rtol=0)
        for name, value in a.metrics.items():
            torch.testing.assert_close(b.metrics[name], value, atol=self.atol, rtol=0, msg=name)

    def test_on_policy_gradient_follows_the_advantage(self) -> None:
        """d loss / d log_prob_i has the sign of -A_i: descent raises the log-prob of a sample with a
        positive advantage and lowers it for a negative one. Forward-process points: at θ = θ_old
        = θ_ref, descent moves the velocity toward the target for A > 0, away from it for A < 0."""
        if self.forward:
            batch = self.make_forward_batch(seed=3)
            batch = attrs.evolve(
                batch, ref_velocity=batch.velocity.detach().clone(), old_velocity=batch.velocity.detach().clone()
            )
            self.call(self.make_objective(), batch).loss.backward()
            grad = batch.velocity.grad
            assert grad is not None, "the loss does not depend on the velocity"
            toward = (-grad * (batch.target - batch.velocity.detach())).flatten(1).sum(1)
            adv = batch.advantages
            assert torch.all(torch.sign(toward) == torch.sign(adv)), (
                f"descent . (target - v) = {toward.tolist()} for advantages {adv.tolist()}"
            )
            return
        steps = self.make_step_batch(seed=3)
        self.call(self.make_objective(), steps).loss.backward()
        grad, adv = steps.log_prob.grad, steps.advantages
        assert grad is not None, "the loss does not depend on the new log-probs"
        assert torch.all(torch.sign(grad) == -torch.sign(adv)), (
            f"gradient {grad.tolist()} for advantages {adv.tolist()}"
        )

    # --- the reference --------------------------------------------------------------------------

    def test_reference_used_only_when_asked_for(self) -> None:
        objective = self.make_objective()
        with_ref = self.call(objective, self.make_batch(seed=4, on_policy=False)).loss
        if not objective.needs_reference:
            without = self.call(objective, self.make_batch(seed=4, on_policy=False, reference=False)).loss
            assert torch.equal(with_ref, without), "the loss depends on a reference the objective did not ask for"
            return
        batch = self.make_batch(seed=4, on_policy=False)
        assert batch.ref_velocity is not None  # make_batch's reference
        moved: StepBatch | ForwardBatch
        if isinstance(batch, ForwardBatch):
            moved = attrs.evolve(batch, ref_velocity=batch.ref_velocity + 0.5)
        else:
            assert batch.ref_mean is not None
            moved = attrs.evolve(batch, ref_mean=batch.ref_mean + 0.5, ref_velocity=batch.ref_velocity + 0.5)
        assert not torch.equal(self.call(objective, moved).loss, with_ref), (
            "moving the reference did not move the loss"
        )

    # --- forward-process objectives ---------------------------------------------------------------

    def skip_unless_forward(self) -> None:
        if not self.forward:
            pytest.skip("the objective trains on transitions")

    def test_old_policy_used_only_when_kept(self) -> None:
        self.skip_unless_forward()
        objective = self.make_objective()
        keeps = objective.needs_old
        batch = self.make_forward_batch(seed=5, on_policy=False)
        loss = self.call(objective, batch).loss
        if not keeps:
            without = self.call(objective, self.make_forward_batch(seed=5, on_policy=False, old=False)).loss
            assert torch.equal(loss, without), "the loss depends on an old policy the objective does not keep"
            return
        assert batch.old_velocity is not None  # make_forward_batch's old policy
        moved = attrs.evolve(batch, old_velocity=batch.old_velocity + 0.5)
        assert not torch.equal(self.call(objective, moved).loss, loss), "moving the old policy did not move the loss"
        for steps in (0, 1, 10, 100, 1000, 10**6):
            decay = objective.old_decay(steps)
            assert 0.0 <= decay < 1.0, f"old_decay({steps}) = {decay}; allowed: [0, 1)"

    def test_point_times_are_reproducible_noise_levels(self) -> None:
        self.skip_unless_forward()
        objective = self.make_objective()
        sigmas = torch.linspace(1.0, 0.0, 11)
        a = objective.point_times(sigmas, torch.Generator().manual_seed(0))
        b = objective.point_times(sigmas, torch.Generator().manual_seed(0))
        assert a.ndim == 1 and len(a) >= 1 and a.is_floating_point()
        assert torch.equal(a, b), "the same generator seed drew other noise levels"
        assert bool(((a > 0) & (a <= 1)).all()), f"noise levels {a.tolist()} outside (0, 1]"

    def test_pairs_lie_in_one_group_and_prefer_the_higher_advantage(self) -> None:
        self.skip_unless_forward()
        objective = self.make_objective()
        if not objective.pairwise:
            pytest.skip("not pairwise")
        groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
        advantages = torch.tensor([0.5, -1.0, 0.5, 0.0, 0.0, 0.0, 2.0, -2.0])
        pairs = objective.pairs(advantages, groups)
        assert pairs.ndim == 2 and pairs.shape[1] == 2 and len(pairs) >= 2
        for w, loser in pairs.tolist():
            assert groups[w] == groups[loser] and advantages[w] > advantages[loser], (w, loser)
        assert 1 not in groups[pairs[:, 0]].tolist(), "a group whose samples score the same gave a pair"

    def test_check_recipe(self) -> None:
        check = getattr(self.make_objective(), "check_recipe", None)
        if check is None:
            pytest.skip("no check_recipe")
        sampler = (
            {"name": "ode", "kernel": {"name": "dpmpp2m"}}
            if self.forward
            else {"name": "full", "kernel": {"name": "sde", "eta": 0.7}}
        )
        resolved: Mapping[str, Any] = {
            "objective": {"name": self.objective_name or "objective", **self.objective_params},
            "sampler": sampler,
        }
        errors = check(resolved)
        assert isinstance(errors, list) and all(isinstance(e, ConfigError) for e in errors)


__all__ = ["ObjectiveConformance"]
