"""DGPO (``objective: {name: dgpo}``): the group-weighted loss checked by hand, against a naive
float64 twin written from the reference's code, at the reference (θ = θ_ref), through the
conformance suite, ``fgrpo check`` and a stop-and-resume."""

from __future__ import annotations

import math

import pytest
import torch

from _helpers import assert_same_training, metric_rows, registration, stop_and_resume
from fgrpo.core import cli, registry
from fgrpo.core.objectives.dgpo import DGPO
from fgrpo.core.protocols import ForwardBatch
from fgrpo.core.testing import ObjectiveConformance

DGPO_SET = "objective={name: dgpo, dpo_beta: 5.0, trunc_steps: 4, timesteps: 2}"


#: the entry point, where the editable install predates it (a fresh install registers it)
dgpo_registered = registration("objective", "dgpo", DGPO)


def batch(x0, noise, v, v_ref, adv, groups, t=None, grad=True) -> ForwardBatch:
    f = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    x0, noise, v, v_ref = f(x0), f(noise), f(v), f(v_ref)
    tt = f(t if t is not None else [0.5] * len(adv))
    return ForwardBatch(
        advantages=f(adv),
        t=tt,
        x0=x0,
        noise=noise,
        x_t=(1 - tt[:, None]) * x0 + tt[:, None] * noise,
        velocity=v.requires_grad_(grad),
        ref_velocity=v_ref,
        groups=torch.tensor(groups),
    )


# --- (1) by hand ----------------------------------------------------------------------------------


def test_hand_computation():
    # one group of two one-pixel samples, x0 = 0, noise = 1: target 1; v = (1.5, 0), v_ref = 1
    # e = (0.25, 1.0), e_ref = (0, 0); A = (1, -1), β = 2, G = 2
    # s = (1 x 2 x 0.25 - 1 x 2 x 1.0) / 2 = -0.75; σ(s) = 1 / (1 + e^0.75) = 0.3208213
    # loss = mean(σ A e) = 0.3208213 x (0.25 - 1.0) / 2 = -0.1203080
    # d/dv_i = σ A_i 2 (v_i - 1) / 2: (0.3208213 x 0.5, 0.3208213 x 1.0) = (0.1604107, 0.3208213)
    # group_nll = -log σ(-s) = log(1 + e^-0.75) = log 1.4723666 = 0.3868710
    b = batch([[0.0], [0.0]], [[1.0], [1.0]], [[1.5], [0.0]], [[1.0], [1.0]], [1.0, -1.0], [0, 0])
    out = DGPO(dpo_beta=2.0)(b)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.1203080, abs=1e-7)
    assert b.velocity.grad.squeeze(1).tolist() == pytest.approx([0.1604107, 0.3208213], abs=1e-7)
    assert out.metrics["group_nll"].item() == pytest.approx(0.3868710, abs=1e-7)


# --- (2) a naive float64 twin of compute_group_dgpo_loss_allreduce (DGPO 01ceb4b, lines 162-192) ---


def twin(model_v, ref_v, target_v, advantages, group_ids, beta_dpo, group_size, beta_kl, adv_clip):
    """Loops over rows, as train_sd3_dgpo.py: dsm = mean (target - v)², per-sample term
    A β (dsm - ref_dsm) / G summed per group (detached), loss = mean(sigmoid(sum) A dsm) + beta KL."""
    n = model_v.shape[0]
    adv = [max(-adv_clip, min(adv_clip, float(a))) for a in advantages]
    dsm = [((target_v[i] - model_v[i]) ** 2).mean() for i in range(n)]
    ref = [float(((target_v[i] - ref_v[i]) ** 2).mean()) for i in range(n)]
    sums: dict[int, float] = {}
    for i in range(n):
        sums[group_ids[i]] = sums.get(group_ids[i], 0.0) + adv[i] * beta_dpo * (float(dsm[i]) - ref[i]) / group_size
    loss = 0.0
    for i in range(n):
        w = 1.0 / (1.0 + math.exp(-sums[group_ids[i]]))
        loss = loss + w * adv[i] * dsm[i] / n
    if beta_kl:
        loss = loss + beta_kl * sum(((model_v[i] - ref_v[i]) ** 2).mean() for i in range(n)) / n
    return loss


@pytest.mark.parametrize("beta", [0.0, 0.02])
def test_equals_a_naive_float64_twin_in_loss_and_gradient(beta):
    g = torch.Generator().manual_seed(0)
    n, shape = 12, (3, 2, 2)
    x0, noise = (
        torch.randn(n, *shape, generator=g, dtype=torch.float64),
        torch.randn(n, *shape, generator=g, dtype=torch.float64),
    )
    v = noise - x0 + 0.3 * torch.randn(n, *shape, generator=g, dtype=torch.float64)
    ref = v + 0.2 * torch.randn(n, *shape, generator=g, dtype=torch.float64)
    adv = 3 * torch.randn(n, generator=g, dtype=torch.float64)  # some beyond ±adv_clip 5
    adv[0] = 7.0
    groups = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]
    objective = DGPO(dpo_beta=10.0, beta=beta)
    t = torch.full((n,), 0.5, dtype=torch.float64)
    b = ForwardBatch(
        advantages=adv,
        t=t,
        x0=x0,
        noise=noise,
        x_t=0.5 * x0 + 0.5 * noise,
        velocity=v.clone().requires_grad_(True),
        ref_velocity=ref,
        groups=torch.tensor(groups),
    )
    out = objective(b)
    out.loss.backward()
    v2 = v.clone().requires_grad_(True)
    want = twin(v2, ref, noise - x0, adv.tolist(), groups, 10.0, 4, beta, 5.0)
    want.backward()
    assert abs(out.loss.item() - want.item()) < 1e-6
    torch.testing.assert_close(b.velocity.grad, v2.grad, atol=1e-6, rtol=0)


# --- (3) at the reference ---------------------------------------------------------------------------


def test_at_the_reference_weights_are_half_and_the_group_nll_is_log_2():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(6, 4, generator=g, dtype=torch.float64)
    x0, noise = (
        torch.randn(6, 4, generator=g, dtype=torch.float64),
        torch.randn(6, 4, generator=g, dtype=torch.float64),
    )
    adv = [1.0, -0.5, -0.5, 2.0, -1.0, -1.0]
    b = batch(x0.tolist(), noise.tolist(), v.tolist(), v.tolist(), adv, [0, 0, 0, 1, 1, 1])
    out = DGPO(dpo_beta=100.0)(b)
    e = ((v - (noise - x0)) ** 2).mean(1)
    assert out.loss.item() == pytest.approx(
        0.5 * (torch.tensor(adv, dtype=torch.float64) * e).mean().item(), abs=1e-6
    )  # float32 inside
    assert out.metrics["group_nll"].item() == pytest.approx(math.log(2), abs=1e-7)
    assert out.metrics["group_weight"].item() == 0.5


def test_check_passes_on_the_vector_recipe(root, capsys):
    assert (
        cli.main(
            [
                "check",
                str(root / "recipes" / "vector.yaml"),
                "--set",
                "sampler={name: ode, steps: 10, kernel: dpmpp2m}",
                "--set",
                DGPO_SET,
            ]
        )
        == 0
    )
    assert "on-policy check passed" in capsys.readouterr().out


# --- (4) conformance --------------------------------------------------------------------------------


class TestDGPOConformance(ObjectiveConformance):
    objective_name = "dgpo"
    objective_params = {"dpo_beta": 10.0}
    bad_params = {"dpo_beta": 0.0}


class TestDGPOWithKLConformance(ObjectiveConformance):
    objective_name = "dgpo"
    objective_params = {"dpo_beta": 10.0, "beta": 0.02}


def test_registered_as_dgpo():
    assert registry.load("objective", "dgpo") is DGPO
    assert registry.create("objective", "dgpo").dpo_beta == 100.0  # the reference's config.train.beta_dpo


# --- (5) stop and resume ----------------------------------------------------------------------------


def test_stop_and_resume_is_bit_exact(root, tmp_path):
    sets = ["--set", "sampler={name: ode, steps: 10, kernel: dpmpp2m}", "--set", DGPO_SET]
    sets += ["--set", "train.iterations=6", "--set", "train.checkpoint_every=3"]
    sets += ["--set", "eval.every=4", "--set", "log.plots=false", "--set", "log.trackers=[]", "--quiet"]
    a, b = stop_and_resume(root / "recipes" / "vector.yaml", tmp_path, sets, stop=4, newest=3)
    assert_same_training(a, b)
    assert any("group_nll" in k for r in metric_rows(a) for k in r)
