"""Flow-DPPO (``objective: {name: flow-dppo}``): the exact-KL trust region, checked by hand, against
a naive float64 twin written from the reference's code, on-policy in a real iteration, through the
conformance suite, ``fgrpo check`` and a stop-and-resume."""

from __future__ import annotations

import math

import pytest
import torch
from rich.console import Console

from _helpers import assert_same_training, metric_rows, stop_and_resume
from fgrpo.core import cli, registry
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.building import build_run
from fgrpo.core.objectives.flow_dppo import FlowDPPO
from fgrpo.core.protocols import StepBatch
from fgrpo.core.testing import ObjectiveConformance
from fgrpo.core.trainer import iteration

QUIET = Console(quiet=True)
DPPO = "objective={name: flow-dppo}"


def t(values, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


# --- (1) by hand -------------------------------------------------------------------------------


def hand_batch() -> StepBatch:
    """Four samples, 2 dims, std 0.5 (2 s^2 = 0.5), threshold 0.05:
    0: A = +1, dlogp = +0.1, delta = (0.2, 0.2): kl = mean(0.04, 0.04) / 0.5 = 0.08 >= τ, ratio > 1, A > 0: dropped
    1: A = -1, dlogp = -0.1, delta = (0.2, 0.2): kl = 0.08 >= τ, ratio < 1, A < 0: dropped
    2: A = +1, dlogp = -0.1, delta = (0.2, 0.2): kl = 0.08 >= τ but ratio < 1 with A > 0 (back toward old): kept
    3: A = +2, dlogp = +0.2, delta = (0.1, 0.0): kl = mean(0.01, 0) / 0.5 = 0.01 < τ: kept however aggressive
    """
    old_mean = t([[0.0, 0.0], [1.0, 1.0], [0.5, -0.5], [0.0, 0.0]])
    return StepBatch(
        log_prob=t([0.1, -0.1, -0.1, 0.2], grad=True),
        old_log_prob=t([0.0, 0.0, 0.0, 0.0]),
        advantages=t([1.0, -1.0, 1.0, 2.0]),
        mean=(old_mean + t([[0.2, 0.2], [0.2, 0.2], [-0.2, 0.2], [0.1, 0.0]])).requires_grad_(True),
        old_mean=old_mean,
        std=t([0.5, 0.5, 0.5, 0.5]),
        dt=t([-0.1, -0.1, -0.1, -0.1]),
    )


def test_hand_computed_loss_gradient_and_masks():
    batch = hand_batch()
    out = FlowDPPO(kl_mask_threshold=0.05)(batch)
    # loss = (0 + 0 - 1 * e^-0.1 - 2 * e^0.2) / 4 = (-0.904837418 - 2.442805516) / 4
    assert out.loss.item() == pytest.approx(-0.836910734, abs=1e-9)
    out.loss.backward()
    # d loss / d logp_i = keep_i * (-A_i * ratio_i) / 4 = [0, 0, -e^-0.1 / 4, -2 e^0.2 / 4]
    assert batch.log_prob.grad is not None
    torch.testing.assert_close(batch.log_prob.grad, t([0.0, 0.0, -0.226209354, -0.610701379]), atol=1e-9, rtol=0)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert (m["clipfrac"], m["clipfrac_above"], m["clipfrac_below"], m["kl_mask_fraction"]) == (0.5, 0.25, 0.25, 0.75)
    assert m["kl_new_old_max"] == pytest.approx(0.08, abs=1e-12)
    assert m["kl_new_old_mean"] == pytest.approx((3 * 0.08 + 0.01) / 4, abs=1e-12)
    assert batch.mean.grad is None  # the KL only decides the mask: no gradient through it


def test_hand_computed_without_the_std():
    # add_kl_coefficient false: kl = mean delta^2 / 2 = 0.02 (samples 0-2) and 0.0025 (3), all < 0.05: all kept
    # loss = (-e^0.1 + e^-0.1 - e^-0.1 - 2 e^0.2) / 4 = -(1.105170918 + 2.442805516) / 4
    out = FlowDPPO(kl_mask_threshold=0.05, add_kl_coefficient=False)(hand_batch())
    assert out.loss.item() == pytest.approx(-0.886994109, abs=1e-9)
    assert out.metrics["clipfrac"].item() == 0.0 and out.metrics["kl_new_old_max"].item() == pytest.approx(0.02)


def test_the_threshold_is_strict_and_an_overflowing_dropped_ratio_gives_no_nan():
    # kl == τ exactly is outside (the reference keeps kl < τ only); a dropped ratio of e^1000 = inf stays out
    batch = StepBatch(
        log_prob=t([1000.0, 0.5], grad=True),
        old_log_prob=t([0.0, 0.0]),
        advantages=t([1.0, 1.0]),
        mean=t([[1.0], [0.0]], grad=True),
        old_mean=t([[0.0], [0.0]]),
        std=t([1.0, 1.0]),
        dt=t([-0.1, -0.1]),
    )
    out = FlowDPPO(kl_mask_threshold=0.5)(batch)  # sample 0: kl = 1 / 2 = τ
    assert out.metrics["clipfrac_above"].item() == 0.5
    assert out.loss.item() == pytest.approx(-math.exp(0.5) / 2, abs=1e-12)
    out.loss.backward()
    assert batch.log_prob.grad is not None and torch.isfinite(batch.log_prob.grad).all()


# --- (2) a naive float64 twin of the reference ---------------------------------------------------


def naive_loss(logp, old_logp, adv, mean, old_mean, std, ref_mean, *, tau, adv_clip, kl_beta, coefficient):
    """UniRL's ``_flowdppo_kl_adv_loss`` + ``loss_per_elem.mean()`` (unirl/algorithms/flowdppo.py:86-111,
    319), written with loops over samples and dims, plus fgrpo's adv_clip and beta * mean KL to the
    reference (grpo's ``kl_form: mean``)."""
    b, d = len(logp), len(mean[0])
    total = 0.0
    kl_ref = 0.0
    for i in range(b):
        a = min(max(float(adv[i]), -adv_clip), adv_clip)
        ratio = torch.exp(logp[i] - old_logp[i])
        sigma = float(std[i]) if coefficient else 1.0
        kl = sum((mean[i][k].item() - old_mean[i][k].item()) ** 2 / (2 * sigma**2) for k in range(d)) / d
        keep_kl = kl < tau
        pos_rm = (not keep_kl) and ratio.item() > 1.0 and a > 0
        neg_rm = (not keep_kl) and ratio.item() < 1.0 and a < 0
        if not (pos_rm or neg_rm):
            total = total + (-a * ratio)
        if kl_beta:
            kl_ref = kl_ref + sum((mean[i][k] - ref_mean[i][k]) ** 2 for k in range(d)) / d / (2 * float(std[i]) ** 2)
    return total / b + kl_beta * kl_ref / b


@pytest.mark.parametrize("coefficient", [True, False])
@pytest.mark.parametrize("kl_beta", [0.0, 0.3])
def test_equals_a_naive_float64_twin_in_loss_and_gradient(coefficient, kl_beta):
    g = torch.Generator().manual_seed(7)
    b, d = 64, 5
    old_logp = torch.randn(b, generator=g, dtype=torch.float64)
    logp = (old_logp + 0.05 * torch.randn(b, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = 3.0 * torch.randn(b, generator=g, dtype=torch.float64)  # some beyond adv_clip = 2
    old_mean = torch.randn(b, d, generator=g, dtype=torch.float64)
    # KLs spread over decades around τ: some inside, some outside
    mean = old_mean + torch.randn(b, d, generator=g, dtype=torch.float64) * torch.logspace(-4, -1, b).double()[:, None]
    mean.requires_grad_(True)
    std = 0.2 + 0.5 * torch.rand(b, generator=g, dtype=torch.float64)
    ref_mean = old_mean + 0.05 * torch.randn(b, d, generator=g, dtype=torch.float64)
    tau = 1e-4
    objective = FlowDPPO(kl_mask_threshold=tau, add_kl_coefficient=coefficient, adv_clip=2.0, kl_beta=kl_beta)
    batch = StepBatch(
        log_prob=logp,
        old_log_prob=old_logp,
        advantages=adv,
        mean=mean,
        old_mean=old_mean,
        std=std,
        dt=-torch.full((b,), 0.1, dtype=torch.float64),
        ref_mean=ref_mean if kl_beta else None,
    )
    out = objective(batch)
    m = out.metrics
    assert (
        0 < m["clipfrac_above"].item() and 0 < m["clipfrac_below"].item() and m["clipfrac"] < m["kl_mask_fraction"] < 1
    )
    (grad_logp, grad_mean) = torch.autograd.grad(out.loss, (logp, mean), allow_unused=True)

    logp2 = logp.detach().clone().requires_grad_(True)
    mean2 = mean.detach().clone().requires_grad_(True)
    twin = naive_loss(
        logp2,
        old_logp,
        adv,
        mean2,
        old_mean,
        std,
        ref_mean,
        tau=tau,
        adv_clip=2.0,
        kl_beta=kl_beta,
        coefficient=coefficient,
    )
    twin_logp, twin_mean = torch.autograd.grad(twin, (logp2, mean2), allow_unused=True)
    assert abs(out.loss.item() - twin.item()) <= 1e-6
    torch.testing.assert_close(grad_logp, twin_logp, atol=1e-6, rtol=0)
    if kl_beta:
        torch.testing.assert_close(grad_mean, twin_mean, atol=1e-6, rtol=0)
    else:
        assert grad_mean is None and twin_mean is None


# --- (3) on-policy: the first update's divergence is exactly 0 and its ratio exactly 1 ----------


def vector_recipe(root, *overrides):
    return recipe_mod.load(root / "recipes" / "vector.yaml", [DPPO, *overrides])


def test_first_update_is_on_policy_with_zero_divergence(root):
    on_policy = build_run(vector_recipe(root, "train.minibatch_size=0"), out_dir=None, console=QUIET, quiet=True)
    assert isinstance(on_policy.objective, FlowDPPO)
    metrics = iteration(on_policy, 0)  # one optimizer step: every pass sees the sampling weights
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0 and metrics["first_ratio_deviation"] == 0.0
    assert metrics["kl_new_old_max"] == 0.0 and metrics["clipfrac"] == 0.0
    run = build_run(vector_recipe(root), out_dir=None, console=QUIET, quiet=True)
    metrics = iteration(run, 0)  # 4 minibatches: the first is on-policy, the later ones are not
    assert metrics["first_ratio_deviation"] == 0.0 and metrics["optimizer_steps"] == 4
    assert metrics["kl_new_old_max"] > 0.0


# --- (4) conformance ---------------------------------------------------------------------------


class TestFlowDPPOConformance(ObjectiveConformance):
    objective_name = "flow-dppo"
    objective_params = {"kl_mask_threshold": 1e-5}
    bad_params = {"kl_mask_threshold": 0.0}


class TestFlowDPPOWithReferenceConformance(ObjectiveConformance):
    objective_name = "flow-dppo"
    objective_params = {"kl_mask_threshold": 1e-3, "add_kl_coefficient": False, "kl_beta": 0.04}


def test_registered_as_flow_dppo():
    assert registry.load("objective", "flow-dppo") is FlowDPPO
    assert registry.create("objective", "flow-dppo").kl_mask_threshold == 1e-5  # the reference's default


# --- (5) fgrpo check -----------------------------------------------------------------------------


def test_check_passes_on_the_vector_recipe(root, capsys):
    assert cli.main(["check", str(root / "recipes" / "vector.yaml"), "--set", DPPO]) == 0
    assert "on-policy check passed" in capsys.readouterr().out


# --- (6) stop and resume -------------------------------------------------------------------------


def test_stop_and_resume_is_bit_exact(root, tmp_path):
    """Stopped after iteration 5 with the checkpoint of iteration 3 as the newest, then resumed: the
    weights and every metric equal an uninterrupted run's."""
    sets = ["--set", DPPO, "--set", "train.iterations=8", "--set", "train.checkpoint_every=3"]
    sets += ["--set", "eval.every=4", "--set", "log.plots=false", "--set", "log.trackers=[]", "--quiet"]
    a, b = stop_and_resume(root / "recipes" / "vector.yaml", tmp_path, sets, stop=5, newest=3)
    assert_same_training(a, b)
    assert any(r.get("kl_new_old_max", 0.0) > 0 for r in metric_rows(a))
