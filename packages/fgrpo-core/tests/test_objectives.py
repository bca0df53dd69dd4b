"""GRPO and GRPO-Guard on hand-computed minibatches (float64 so that values compare tightly)."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.config import RecipeError
from fgrpo.core.objectives import GRPO, GRPOGuard
from fgrpo.core.protocols import Objective, StepBatch
from fgrpo.core.testing import ObjectiveConformance

D64 = torch.float64


def t(values, grad=False):
    return torch.tensor(values, dtype=D64, requires_grad=grad)


def batch(log_prob, old_log_prob, advantages, *, mean=None, old_mean=None, std=None, dt=None, **kw):
    b = log_prob.shape[0]
    mean = torch.zeros(b, 2, dtype=D64) if mean is None else mean
    return StepBatch(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        mean=mean,
        old_mean=mean.detach().clone() if old_mean is None else old_mean,
        std=torch.ones(b, dtype=D64) if std is None else std,
        dt=-torch.ones(b, dtype=D64) if dt is None else dt,
        **kw,
    )


def log_probs_for(ratios, old=(0.3, -0.7, 1.1)):
    old = t(old[: len(ratios)])
    new = (old + torch.log(t(ratios))).detach().requires_grad_(True)
    return new, old


# --- GRPO -------------------------------------------------------------------------------------


def test_grpo_clips_on_both_sides():
    # eps = 0.1. Sample 0: A = +1, ratio 1.2 -> clipped above, -1.1. Sample 1: A = -2, ratio 0.8
    # -> clipped below, -(-2) * 0.9 = 1.8. Sample 2: A = 0.5, ratio 1.05 -> inside, -0.525.
    new, old = log_probs_for([1.2, 0.8, 1.05])
    out = GRPO(clip_range=0.1)(batch(new, old, t([1.0, -2.0, 0.5])))
    assert out.loss.item() == pytest.approx((-1.1 + 1.8 - 0.525) / 3, abs=1e-12)
    out.loss.backward()
    # d/dlogp of -A r / 3 where unclipped; nothing where the clip binds.
    torch.testing.assert_close(new.grad, t([0.0, 0.0, -0.5 * 1.05 / 3]))


def test_grpo_metrics():
    new, old = log_probs_for([1.2, 0.8, 1.05])
    m = GRPO(clip_range=0.1)(batch(new, old, t([1.0, -2.0, 0.5]))).metrics
    expected = {
        "ratio_mean": (1.2 + 0.8 + 1.05) / 3,
        "ratio_min": 0.8,
        "ratio_max": 1.2,
        "clipfrac": 2 / 3,
        "clipfrac_above": 1 / 3,
        "clipfrac_below": 1 / 3,
        "approx_kl": 0.014235779114094781,  # 0.5 * mean(ln(1.2)^2, ln(0.8)^2, ln(1.05)^2)
        "policy_loss": 0.175 / 3,
        "kl": 0.0,
        "loss": 0.175 / 3,
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert not m[key].requires_grad and m[key].ndim == 0
        assert m[key].item() == pytest.approx(value, abs=1e-12), key


def test_grpo_pessimistic_side_keeps_gradient():
    # A = +1 with ratio 0.8 and A = -1 with ratio 1.2: the clip does not bind, the gradient flows
    # (clipfrac still counts them: it measures the ratio, whatever the advantage's sign).
    new, old = log_probs_for([0.8, 1.2])
    out = GRPO(clip_range=0.1)(batch(new, old, t([1.0, -1.0])))
    assert out.loss.item() == pytest.approx((-0.8 + 1.2) / 2, abs=1e-12)
    out.loss.backward()
    torch.testing.assert_close(new.grad, t([-0.8 / 2, 1.2 / 2]))
    assert out.metrics["clipfrac"].item() == 1.0


def test_advantages_are_clipped():
    logp = t([0.1, 0.2, 0.3], grad=True)
    out = GRPO(adv_clip=5.0)(batch(logp, logp.detach(), t([7.0, -9.0, 2.0])))
    assert out.loss.item() == pytest.approx(-(5.0 - 5.0 + 2.0) / 3, abs=1e-12)
    out = GRPO(adv_clip=1.0)(batch(logp, logp.detach(), t([7.0, -9.0, 0.5])))
    assert out.loss.item() == pytest.approx(-(1.0 - 1.0 + 0.5) / 3, abs=1e-12)


def test_on_policy_ratio_is_exactly_one():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, generator=g).requires_grad_(True)  # float32, as the kernels produce
    adv = torch.randn(6, generator=g)
    out = GRPO()(
        StepBatch(
            log_prob=logp,
            old_log_prob=logp.detach().clone(),
            advantages=adv,
            mean=torch.zeros(6, 3),
            old_mean=torch.zeros(6, 3),
            std=torch.ones(6),
            dt=-torch.ones(6),
        )
    )
    assert out.metrics["ratio_min"].item() == 1.0 and out.metrics["ratio_max"].item() == 1.0
    assert out.metrics["clipfrac"].item() == 0.0 and out.metrics["approx_kl"].item() == 0.0
    assert out.loss.item() == pytest.approx(-adv.mean().item(), abs=1e-7)


def test_kl_mean_value_and_gradient():
    # delta = mu - mu_ref = [[0.2, -0.2], [0, 0.4]]; mean delta^2 = [0.04, 0.08];
    # / (2 std^2) with std = [0.5, 2] -> [0.08, 0.01]; KL = 0.045.
    mean = t([[0.3, -0.1], [0.0, 0.4]], grad=True)
    ref = t([[0.1, 0.1], [0.0, 0.0]])
    logp = t([0.0, 0.0], grad=True)
    objective = GRPO(kl_beta=0.5)
    assert objective.needs_reference
    out = objective(batch(logp, logp.detach(), t([1.0, -1.0]), mean=mean, std=t([0.5, 2.0]), ref_mean=ref))
    assert out.metrics["kl"].item() == pytest.approx(0.045, abs=1e-12)
    assert out.metrics["policy_loss"].item() == pytest.approx(0.0, abs=1e-12)
    assert out.loss.item() == pytest.approx(0.5 * 0.045, abs=1e-12)
    out.loss.backward()
    # d/dmu = beta * delta / (B * D * std^2)
    torch.testing.assert_close(mean.grad, t([[0.1, -0.1], [0.0, 0.0125]]))


def test_kl_velocity_value_and_gradient():
    v = t([[1.0, 2.0], [0.5, 0.5]], grad=True)
    v_ref = t([[0.0, 2.0], [0.5, -0.5]])
    logp = t([0.0, 0.0], grad=True)
    objective = GRPO(kl_beta=0.1, kl_form="velocity")
    out = objective(batch(logp, logp.detach(), t([1.0, -1.0]), velocity=v, ref_velocity=v_ref))
    assert out.metrics["kl"].item() == pytest.approx(0.5, abs=1e-12)
    assert out.loss.item() == pytest.approx(0.05, abs=1e-12)
    out.loss.backward()
    # d/dv = beta * 2 delta / (B * D)
    torch.testing.assert_close(v.grad, t([[0.05, 0.0], [0.0, 0.05]]))


def test_kl_needs_the_reference():
    assert not GRPO().needs_reference
    logp = t([0.0], grad=True)
    out = GRPO()(batch(logp, logp.detach(), t([1.0])))  # beta 0: ref_* never read
    assert out.metrics["kl"].item() == 0.0
    with pytest.raises(ValueError, match="ref_mean"):
        GRPO(kl_beta=0.1)(batch(logp, logp.detach(), t([1.0])))
    with pytest.raises(ValueError, match="ref_velocity"):
        GRPO(kl_beta=0.1, kl_form="velocity")(batch(logp, logp.detach(), t([1.0])))


# --- GRPO-Guard -------------------------------------------------------------------------------


def test_guard_ratio_is_exactly_one_on_policy():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(4, generator=g).requires_grad_(True)
    mean = torch.randn(4, 3, 2, generator=g).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0])
    dt = torch.tensor([-0.1, -0.25, -0.5, -0.05])
    out = GRPOGuard()(
        StepBatch(
            log_prob=logp,
            old_log_prob=logp.detach().clone(),
            advantages=adv,
            mean=mean,
            old_mean=mean.detach().clone(),
            std=torch.tensor([0.3, 0.2, 0.1, 0.05]),
            dt=dt,
        )
    )
    assert out.metrics["ratio_min"].item() == 1.0 and out.metrics["ratio_max"].item() == 1.0
    assert out.loss.item() == pytest.approx((-adv / -dt).mean().item(), rel=1e-6)


def test_guard_hand_case():
    # One sample, c = 0.5, mu_old = [0, 0], mu = [0.1, -0.2], x' = [0.3, 0.1].
    # Gaussian log-ratio: mean((x'-mu_old)^2 - (x'-mu)^2) / (2c^2) = mean([0.05, -0.08]) / 0.5 = -0.03.
    # shift = mean(delta^2) / (2c^2) = 0.025 / 0.5 = 0.05; ratio = exp((-0.03 + 0.05) * 0.5) = e^0.01.
    old_logp = t([0.5])
    logp = t([0.5 - 0.03], grad=True)
    mean = t([[0.1, -0.2]], grad=True)
    out = GRPOGuard(clip_range=0.1)(
        batch(
            logp,
            old_logp,
            t([1.0]),
            mean=mean,
            old_mean=t([[0.0, 0.0]]),
            std=t([0.5]),
            dt=t([-0.25]),
        )
    )
    assert out.metrics["ratio_mean"].item() == pytest.approx(math.exp(0.01), abs=1e-12)
    assert out.metrics["approx_kl"].item() == pytest.approx(0.5 * 0.03**2, abs=1e-12)  # raw log-ratio
    # -A r / (-dt) = -e^0.01 / 0.25
    assert out.loss.item() == pytest.approx(-4.040200668336672, abs=1e-12)
    out.loss.backward()
    # d/dlogp = -A r c / (-dt); d/dmu = that * d shift/d mu = that * delta / (D c^2) = that * [0.2, -0.4]
    assert logp.grad.item() == pytest.approx(-2.020100334168336, abs=1e-12)
    torch.testing.assert_close(mean.grad, t([[-2.020100334168336 * 0.2, 2.020100334168336 * 0.4]]))


def test_guard_centring_identity():
    # With the kernel's Gaussian log-prob, RatioNorm's log-ratio is mean(e * delta) / c where
    # e = x' - mu_old: the negative bias -mean(delta^2) / (2c^2) is gone.
    g = torch.Generator().manual_seed(2)
    b, d = 5, 8
    c = torch.tensor([0.3, 0.1, 0.7, 0.05, 0.2], dtype=D64)
    old_mean = torch.randn(b, d, generator=g, dtype=D64)
    x_next = old_mean + c[:, None] * torch.randn(b, d, generator=g, dtype=D64)
    mean = old_mean + 0.05 * torch.randn(b, d, generator=g, dtype=D64)

    def gaussian_log_prob(mu):
        s = c[:, None]
        return (-((x_next - mu) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)).mean(1)

    out = GRPOGuard(clip_range=10.0)(
        batch(
            gaussian_log_prob(mean),
            gaussian_log_prob(old_mean),
            torch.ones(b, dtype=D64),
            mean=mean,
            old_mean=old_mean,
            std=c,
            dt=-torch.ones(b, dtype=D64),
        )
    )
    expected_ratio = torch.exp(((x_next - old_mean) * (mean - old_mean)).mean(1) / c)
    # loss = mean(-ratio) here (A = 1, dt = -1, clip wide open)
    assert out.loss.item() == pytest.approx(-expected_ratio.mean().item(), abs=1e-12)
    assert out.metrics["ratio_min"].item() == pytest.approx(expected_ratio.min().item(), abs=1e-12)


def test_guard_reweights_by_minus_dt():
    logp = t([0.0, 0.0], grad=True)
    out = GRPOGuard()(batch(logp, logp.detach(), t([1.0, -0.5]), std=t([0.3, 0.2]), dt=t([-0.1, -0.25])))
    assert out.loss.item() == pytest.approx((-1.0 / 0.1 + 0.5 / 0.25) / 2, abs=1e-12)


def test_guard_equals_grpo_when_c_and_dt_are_one():
    # c = 1, dt = -1, mu = mu_old: RatioNorm and the reweight are the identity, clipping included.
    new, old = log_probs_for([1.2, 0.8, 1.05])
    a = GRPO(clip_range=0.1)(batch(new, old, t([1.0, -2.0, 0.5])))
    b = GRPOGuard(clip_range=0.1)(batch(new, old, t([1.0, -2.0, 0.5])))
    for key in a.metrics:
        assert b.metrics[key].item() == pytest.approx(a.metrics[key].item(), abs=1e-12), key
    (grad_a,) = torch.autograd.grad(a.loss, new)
    (grad_b,) = torch.autograd.grad(b.loss, new)
    torch.testing.assert_close(grad_b, grad_a)
    torch.testing.assert_close(grad_b, t([0.0, 0.0, -0.175]))


def test_guard_kl_is_not_reweighted():
    mean = t([[0.3, -0.1], [0.0, 0.4]], grad=True)
    logp = t([0.0, 0.0], grad=True)
    out = GRPOGuard(kl_beta=0.5)(
        batch(
            logp,
            logp.detach(),
            t([1.0, -1.0]),
            mean=mean,
            std=t([0.5, 2.0]),
            dt=t([-0.1, -0.1]),
            ref_mean=t([[0.1, 0.1], [0.0, 0.0]]),
        )
    )
    assert out.metrics["kl"].item() == pytest.approx(0.045, abs=1e-12)
    assert out.loss.item() == pytest.approx(0.0225, abs=1e-12)


# --- registry and recipe keys -----------------------------------------------------------------


def test_registry_creates_both():
    grpo = registry.create("objective", "grpo", clip_range=1e-4)
    guard = registry.create("objective", "grpo-guard", clip_range="4e-6", kl_beta=0.01)  # YAML 1.1 string
    assert isinstance(grpo, GRPO) and isinstance(guard, GRPOGuard)
    assert guard.clip_range == 4e-6 and guard.needs_reference
    assert isinstance(grpo, Objective) and isinstance(guard, Objective)
    assert GRPO().clip_range == 1e-4 and GRPOGuard().clip_range == 2e-6
    assert (GRPO().adv_clip, GRPO().kl_beta, GRPO().kl_form) == (5.0, 0.0, "mean")


@pytest.mark.parametrize("name", ["grpo", "grpo-guard"])
def test_bad_params_raise_recipe_error(name):
    with pytest.raises(RecipeError) as info:
        registry.create("objective", name, clip_range=0.0, adv_clip=-1.0, kl_beta=-0.5, kl_form="l2", clip=1)
    keys = sorted(e.key for e in info.value.errors)
    assert keys == [
        "objective.adv_clip",
        "objective.clip",
        "objective.clip_range",
        "objective.kl_beta",
        "objective.kl_form",
    ]


# --- flow_grpo's KL scale ---------------------------------------------------------------------


@pytest.mark.parametrize("objective", [GRPO, GRPOGuard])
def test_kl_flow_grpo_is_minus_dt_times_the_exact_kl(objective):
    # flow_grpo: mean (mu - mu_ref)^2 / (2 std_dev_t^2), std_dev_t = g (the step std is g sqrt(-dt))
    mean = t([[0.3, -0.1], [0.0, 0.4]], grad=True)
    ref = t([[0.1, 0.1], [0.0, 0.0]])
    std, dt = t([0.5, 2.0]), t([-0.25, -0.04])
    logp = t([0.0, 0.0], grad=True)
    exact = objective(kl_beta=0.5)(batch(logp, logp.detach(), t([1.0, -1.0]), mean=mean, std=std, dt=dt, ref_mean=ref))
    ours = objective(kl_beta=0.5, kl_form="flow_grpo")(
        batch(logp, logp.detach(), t([1.0, -1.0]), mean=mean, std=std, dt=dt, ref_mean=ref)
    )
    # per sample exact [0.08, 0.01] (see test_kl_mean_value_and_gradient) times -dt [0.25, 0.04]
    assert ours.metrics["kl"].item() == pytest.approx((0.08 * 0.25 + 0.01 * 0.04) / 2, abs=1e-12)
    g = std / torch.sqrt(-dt)  # what flow_grpo divides by
    reference = (((mean - ref) ** 2).mean(dim=1) / (2 * g**2)).mean()
    assert ours.metrics["kl"].item() == pytest.approx(reference.item(), abs=1e-12)
    assert exact.metrics["kl"].item() == pytest.approx(0.045, abs=1e-12)


def test_measured_kl_ratio_on_a_10_step_shift_3_schedule():
    # exact / flow_grpo = 1 / (-dt): 28x at step 0, 12x at step 5, 5.6x at step 8 (docs/method.md)
    grid = torch.linspace(1, 0, 11, dtype=D64)
    sigmas = 3 * grid / (1 + 2 * grid)
    ratio = 1 / (sigmas[:-1] - sigmas[1:])
    assert [round(ratio[i].item(), 1) for i in (0, 5, 8)] == [28.0, 12.0, 5.6]


def _resolved(objective, kernel):
    return {"objective": {"name": "x", "kl_beta": 0.1, **objective}, "sampler": {"name": "full", "kernel": kernel}}


def test_recipe_rules_between_objective_and_kernel():
    cps = {"name": "cps", "eta": 0.8, "normalized_logprob": False}
    errors = GRPOGuard.check_recipe(_resolved({"kl_form": "mean"}, cps))
    assert [e.key for e in errors] == ["sampler.kernel.normalized_logprob"]
    assert "set sampler.kernel.normalized_logprob: true" in errors[0].message
    assert GRPOGuard.check_recipe(_resolved({"kl_form": "mean"}, {**cps, "normalized_logprob": True})) == []
    assert GRPOGuard.check_recipe(_resolved({"kl_form": "mean"}, {"name": "sde", "eta": 0.7})) == []
    assert GRPO.check_recipe(_resolved({"kl_form": "mean"}, cps)) == []  # plain GRPO takes either log-prob
    errors = GRPO.check_recipe(_resolved({"kl_form": "flow_grpo"}, cps))
    assert [e.key for e in errors] == ["objective.kl_form"] and "use kl_form: mean" in errors[0].message
    assert GRPO.check_recipe(_resolved({"kl_form": "flow_grpo"}, {"name": "dance", "eta": 0.3})) == []
    assert GRPO.check_recipe(_resolved({"kl_form": "flow_grpo", "kl_beta": 0.0}, cps)) == []  # no KL at all


# --- the conformance base ---------------------------------------------------------------------------


class TestGRPOConformance(ObjectiveConformance):
    objective_name = "grpo"
    objective_params = {"clip_range": 1e-3}


class TestGRPOMeanKLConformance(ObjectiveConformance):
    objective_name = "grpo"
    objective_params = {"clip_range": 1e-3, "kl_beta": 0.04, "kl_form": "mean"}


class TestGRPOFlowGRPOKLConformance(ObjectiveConformance):
    objective_name = "grpo"
    objective_params = {"clip_range": 1e-3, "kl_beta": 0.04, "kl_form": "flow_grpo"}


class TestGRPOVelocityKLConformance(ObjectiveConformance):
    objective_name = "grpo"
    objective_params = {"kl_beta": 0.04, "kl_form": "velocity"}


class TestGRPOGuardConformance(ObjectiveConformance):
    objective_name = "grpo-guard"


class TestGRPOGuardKLConformance(ObjectiveConformance):
    objective_name = "grpo-guard"
    objective_params = {"clip_range": 4e-6, "kl_beta": 0.01}
