"""nft, awm and dpo: hand computations on small tensors, a deliberately naive second implementation
of each loss written from its reference's definitions (per sample, float64, plain Python loops),
the gradient each has at θ = θ_old, their noise levels, pairs and the old policy's decay."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from fgrpo.core.objectives import AWM, DPO, NFT
from fgrpo.core.objectives._forward import discrete_indices
from fgrpo.core.protocols import ForwardBatch
from fgrpo.core.testing import ObjectiveConformance

D64 = torch.float64


def t64(values, grad=False):
    return torch.tensor(values, dtype=D64, requires_grad=grad)


def points(x0, noise, t, velocity, advantages, old=None, ref=None) -> ForwardBatch:
    x0, noise, t = t64(x0), t64(noise), t64(t)
    tt = t.reshape(-1, *([1] * (x0.dim() - 1)))
    return ForwardBatch(
        advantages=t64(advantages),
        t=t,
        x0=x0,
        noise=noise,
        x_t=(1 - tt) * x0 + tt * noise,
        velocity=t64(velocity, grad=True),
        old_velocity=None if old is None else t64(old),
        ref_velocity=None if ref is None else t64(ref),
    )


def random_points(seed: int, b: int = 6, shape=(3, 2, 2), pairwise: bool = False) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, *shape, generator=g, dtype=D64)
    noise = torch.randn(b, *shape, generator=g, dtype=D64)
    t = 0.05 + 0.95 * torch.rand(b, generator=g, dtype=D64)
    adv = 3 * torch.randn(b, generator=g, dtype=D64)
    if pairwise:
        m = b // 2
        noise[m:], t[m:] = noise[:m], t[:m]
        adv = torch.cat([torch.ones(m, dtype=D64), -torch.ones(m, dtype=D64)])
    tt = t.reshape(-1, *([1] * len(shape)))
    velocity = (noise - x0) + 0.5 * torch.randn(b, *shape, generator=g, dtype=D64)
    return ForwardBatch(
        advantages=adv,
        t=t,
        x0=x0,
        noise=noise,
        x_t=(1 - tt) * x0 + tt * noise,
        velocity=velocity.requires_grad_(True),
        old_velocity=velocity.detach() + 0.3 * torch.randn(b, *shape, generator=g, dtype=D64),
        ref_velocity=velocity.detach() + 0.2 * torch.randn(b, *shape, generator=g, dtype=D64),
    )


def flat(x: torch.Tensor) -> list[float]:
    return [float(v) for v in x.detach().reshape(-1).tolist()]


# --- NFT ----------------------------------------------------------------------------------------

# One point, 2 dims: x0 = [0, 1], noise = [1, -1], t = 0.5 -> x_t = [0.5, 0]; v_θ = [2, -2], v_old = [0, -2].
NFT_POINT = dict(x0=[[0.0, 1.0]], noise=[[1.0, -1.0]], t=[0.5], velocity=[[2.0, -2.0]], old=[[0.0, -2.0]])


def test_nft_by_hand_beta_one():
    # β = 1: v⁺ = v_θ, x̂⁺ = x_t - t v⁺ = [-0.5, 1], e⁺ = [-0.5, 0], w⁺ = 0.25, L⁺ = (0.25 / 2) / 0.25 = 0.5;
    # v⁻ = 2 v_old - v_θ = [-2, -2], x̂⁻ = [1.5, 1], e⁻ = [1.5, 0], w⁻ = 0.75, L⁻ = (2.25 / 2) / 0.75 = 1.5.
    # a = 5. A = +5: r = 1, loss = 5 L⁺ = 2.5. A = -5: r = 0, loss = 5 L⁻ = 7.5. A = 0: r = 1/2, loss = 5.
    for advantage, expected in ((5.0, 2.5), (-5.0, 7.5), (0.0, 5.0), (12.0, 2.5)):
        out = NFT(nft_beta=1.0, kl_beta=0.0)(points(advantages=[advantage], **NFT_POINT))
        assert out.loss.item() == pytest.approx(expected, abs=1e-12), advantage
    # gradient for A = +5: d/dv_θ 5 mean(e²) / w = 5 (2 e / 2)(-t) / w = 5 [-0.5, 0](-0.5) / 0.25 = [5, 0]
    batch = points(advantages=[5.0], **NFT_POINT)
    NFT(nft_beta=1.0, kl_beta=0.0)(batch).loss.backward()
    torch.testing.assert_close(batch.velocity.grad, t64([[5.0, 0.0]]))


def test_nft_by_hand_beta_half_and_kl():
    # β = 0.5: v⁺ = [1, -2], x̂⁺ = [0, 1] = x0: L⁺ = 0 (w floored at 1e-5); v⁻ = 1.5 v_old - 0.5 v_θ = [-1, -2],
    # x̂⁻ = [1, 1], e⁻ = [1, 0], w⁻ = 0.5, L⁻ = 0.5 / 0.5 = 1. A = 0 -> r = 1/2: 5 (0.5 x 0 + 0.5 x 1) / 0.5 = 5.
    # KL to v_ref = [1, -1]: mean (v_θ - v_ref)² = (1 + 1) / 2 = 1; kl_beta 0.1 adds 0.1.
    batch = points(advantages=[0.0], ref=[[1.0, -1.0]], **NFT_POINT)
    out = NFT(nft_beta=0.5, kl_beta=0.1)(batch)
    assert out.metrics["policy_loss"].item() == pytest.approx(5.0, abs=1e-12)
    assert out.metrics["kl"].item() == pytest.approx(1.0, abs=1e-12)
    assert out.loss.item() == pytest.approx(5.1, abs=1e-12)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("positive_only", [2.0, 0.0]),
        ("negative_only", [0.0, -3.0]),
        ("one_only", [1.0, 0.0]),
        ("binary", [1.0, -1.0]),
        ("all", [2.0, -3.0]),
    ],
)
def test_nft_adv_modes(mode, expected):
    from fgrpo.core.objectives.nft import advantage_mode

    assert advantage_mode(t64([2.0, -3.0]), mode, 5.0).tolist() == expected


def naive_nft(batch: ForwardBatch, beta: float, a: float, kl_beta: float, mode: str = "all") -> float:
    """DiffusionNFT's loss, sample by sample and element by element, in float64."""
    total = 0.0
    n = len(batch.t)
    for i in range(n):
        adv = max(-a, min(a, float(batch.advantages[i])))
        if mode == "positive_only":
            adv = max(adv, 0.0)
        elif mode == "negative_only":
            adv = min(adv, 0.0)
        elif mode == "one_only":
            adv = 1.0 if adv > 0 else 0.0
        elif mode == "binary":
            adv = (adv > 0) - (adv < 0)
        r = min(1.0, max(0.0, adv / a / 2.0 + 0.5))
        t = float(batch.t[i])
        x0, xt = flat(batch.x0[i]), flat(batch.x_t[i])
        v, v_old, v_ref = flat(batch.velocity[i]), flat(batch.old_velocity[i]), flat(batch.ref_velocity[i])
        d = len(x0)
        pos = [beta * v[k] + (1 - beta) * v_old[k] for k in range(d)]
        neg = [(1 + beta) * v_old[k] - beta * v[k] for k in range(d)]
        losses = []
        for pred in (pos, neg):
            err = [xt[k] - t * pred[k] - x0[k] for k in range(d)]
            weight = max(sum(abs(e) for e in err) / d, 1e-5)
            losses.append(sum(e * e / weight for e in err) / d)
        kl = sum((v[k] - v_ref[k]) ** 2 for k in range(d)) / d
        total += a * (r * losses[0] / beta + (1 - r) * losses[1] / beta) + kl_beta * kl
    return total / n


@pytest.mark.parametrize(
    "seed, beta, mode",
    [(0, 1.0, "all"), (1, 0.1, "all"), (2, 0.37, "binary"), (3, 1.0, "positive_only"), (4, 0.1, "one_only")],
)
def test_nft_equals_a_naive_reimplementation(seed, beta, mode):
    batch = random_points(seed)
    out = NFT(nft_beta=beta, kl_beta=0.01, adv_mode=mode)(batch)
    assert out.loss.item() == pytest.approx(naive_nft(batch, beta, 5.0, 0.01, mode), abs=1e-6, rel=1e-9)


@pytest.mark.parametrize("beta, clip", [(1.0, 5.0), (0.1, 5.0), (0.37, 2.0)])
def test_nft_gradient_at_theta_old_is_the_advantage_weighted_flow_matching_gradient(beta, clip):
    """At v_θ = v_old: d loss / d v = (t / mean|u - v|) d/dv [Â mean (v - u)²] per point, u = ε - x0,
    Â = clip(A, ±a): the advantage-weighted flow-matching gradient, whatever β and a (docs/method.md)."""
    batch = random_points(7)
    batch = attrs.evolve(batch, old_velocity=batch.velocity.detach().clone())
    NFT(nft_beta=beta, adv_clip=clip, kl_beta=0.0)(batch).loss.backward()
    v = batch.velocity.detach().clone().requires_grad_(True)
    u = batch.target
    adv = batch.advantages.clamp(-clip, clip)
    factor = batch.t / (u - v.detach()).abs().flatten(1).mean(1)
    ((factor * adv * ((v - u) ** 2).flatten(1).mean(1)).mean()).backward()
    torch.testing.assert_close(batch.velocity.grad, v.grad, rtol=1e-9, atol=1e-12)


# --- AWM ----------------------------------------------------------------------------------------


def test_awm_by_hand():
    # One point, v - u = [1, 0]: m = 0.5; t = 0.5; A = 2.5 -> Â = 2.5 / 5 x 1 = 0.5. ratio = 1, so the policy
    # loss is -Â = -0.5 whatever the weighting; its gradient is Â w'(t, m) dm/dv with dm/dv = 2 (v - u) / 2 = [1, 0]:
    # Uniform: w' = 1 -> [0.5, 0]; ghuber (p = 1/4): w' = t (m + 1e-10)^(-3/4) = 0.5 x 0.5^-0.75 = 0.840896 ->
    # [0.420448, 0].
    # KL: v_ref = v + [0, 2] -> mean = 2, beta 0.01 -> 0.02; the lagged policy v_ema = v + [1, 1] -> 1, ema_beta 1 ->
    # 1.
    args = dict(x0=[[0.0, 0.0]], noise=[[1.0, 1.0]], t=[0.5], velocity=[[2.0, 1.0]], advantages=[2.5])
    extra = dict(ref=[[2.0, 3.0]], old=[[3.0, 2.0]])
    for weighting, grad in (
        ("Uniform", 0.5),
        ("ghuber", 0.5 * 0.5 * 0.5**-0.75),
        ("t", 0.25),
        ("t**2", 0.125),
        ("huber", 0.5 * 0.5 / (2 * math.sqrt(0.5))),
    ):
        batch = points(**args, **extra)
        out = AWM(weighting=weighting, kl_beta=0.0, ema_kl_beta=0.0)(batch)
        assert out.loss.item() == pytest.approx(-0.5, abs=1e-12)
        out.loss.backward()
        torch.testing.assert_close(batch.velocity.grad, t64([[grad, 0.0]]), rtol=1e-9, atol=1e-12)
    out = AWM(kl_beta=0.01, ema_kl_beta=1.0)(points(**args, **extra))
    assert out.metrics["kl"].item() == pytest.approx(2.0, abs=1e-12)
    assert out.metrics["ema_kl"].item() == pytest.approx(1.0, abs=1e-12)
    assert out.loss.item() == pytest.approx(-0.5 + 0.02 + 1.0, abs=1e-12)
    # ELBO: divided by 2 s², s = 0.7 sqrt(t / (1 - t)) = 0.7 at t = 0.5 -> 2 s² = 0.98
    out = AWM(kl_beta=0.01, kl_form="ELBO", ema_kl_beta=0.0)(points(**args, **extra))
    assert out.metrics["kl"].item() == pytest.approx(2.0 / 0.98, abs=1e-12)


def naive_awm(batch: ForwardBatch, p: dict) -> float:
    """AWM's loss (train_sd3_awm.py) point by point in float64: the weighted log-prob, the on-policy
    ratio exp(lp - lp_old) = 1 with lp_old = lp, the clipped surrogate, both KL terms."""
    n, total_policy, total_kl, total_ema = len(batch.t), 0.0, 0.0, 0.0
    for i in range(n):
        v, u = flat(batch.velocity[i]), flat(batch.target[i])
        d = len(v)
        m = sum((v[k] - u[k]) ** 2 for k in range(d)) / d
        t = float(batch.t[i])
        lp = {
            "Uniform": -m,
            "t": -m * t,
            "t**2": -m * t * t,
            "huber": -(math.sqrt(m + 1e-10) - 1e-5) * t,
            "ghuber": -((m + 1e-10) ** p["ghuber_power"] - 1e-10 ** p["ghuber_power"]) * t / p["ghuber_power"],
        }[p["weighting"]]
        ratio = math.exp(lp - lp)
        adv = max(-p["adv_clip"], min(p["adv_clip"], float(batch.advantages[i]))) / p["adv_clip"] * p["advantage_max"]
        c = p["clip_range"]
        total_policy += max(-adv * ratio, -adv * min(max(ratio, 1 - c), 1 + c))
        s2 = 2 * (0.7 * math.sqrt(t / (1 - min(max(t, 0.0), 0.99)))) ** 2
        for other, form, key in (
            (batch.ref_velocity, p["kl_form"], "kl"),
            (batch.old_velocity, p["ema_kl_form"], "ema"),
        ):
            o = flat(other[i])
            kl = sum((v[k] - o[k]) ** 2 for k in range(d)) / d
            kl = kl / s2 if form == "ELBO" else kl
            if key == "kl":
                total_kl += kl
            else:
                total_ema += kl
    return total_policy / n + p["kl_beta"] * total_kl / n + p["ema_kl_beta"] * total_ema / n


@pytest.mark.parametrize(
    "seed, keys",
    [
        (0, {}),
        (1, {"weighting": "Uniform", "kl_beta": 0.003, "kl_form": "ELBO"}),
        (2, {"weighting": "huber", "ema_kl_beta": 0.5, "ema_kl_form": "ELBO"}),
        (3, {"weighting": "t**2", "adv_clip": 2.0, "advantage_max": 0.5}),
        (4, {"weighting": "ghuber", "ghuber_power": 0.5, "clip_range": 0.2}),
    ],
)
def test_awm_equals_a_naive_reimplementation(seed, keys):
    objective = AWM(**keys)
    batch = random_points(seed)
    out = objective(batch)
    assert out.loss.item() == pytest.approx(naive_awm(batch, attrs.asdict(objective)), abs=1e-6, rel=1e-9)


@pytest.mark.parametrize("weighting", ["Uniform", "t", "t**2", "huber", "ghuber"])
def test_awm_gradient_at_theta_old_is_the_weighted_flow_matching_gradient(weighting):
    """d loss / d v = w'(t, m) d/dv [Â m] per point (the KL-EMA term has no gradient at v = v_ema)."""
    batch = random_points(8)
    batch = attrs.evolve(batch, old_velocity=batch.velocity.detach().clone())
    objective = AWM(weighting=weighting, kl_beta=0.0)
    objective(batch).loss.backward()
    v = batch.velocity.detach().clone().requires_grad_(True)
    m = ((v - batch.target) ** 2).flatten(1).mean(1)
    md, t = m.detach(), batch.t
    slope = {
        "Uniform": 1.0,
        "t": t,
        "t**2": t**2,
        "huber": t / (2 * torch.sqrt(md + 1e-10)),
        "ghuber": t * (md + 1e-10) ** (0.25 - 1),
    }[weighting]
    adv = batch.advantages.clamp(-5, 5) / 5
    (slope * adv * m).mean().backward()
    torch.testing.assert_close(batch.velocity.grad, v.grad, rtol=1e-9, atol=1e-12)


def test_awm_noise_levels_follow_its_strata():
    # 10 steps x 0.9 -> the last index 9; discrete_wo_init: boundaries linspace(1, 9, 7) = [1, 2.33, 3.67, 5, 6.33,
    # 7.67, 9] -> lower [1, 2, 3, 5, 6, 7], upper [2, 3, 5, 6, 7, 9]: one index per stratum
    sigmas = torch.linspace(1.0, 0.0, 11)
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        index = discrete_indices(1, 9, 6, g, torch.device("cpu"))
        assert [
            lo <= i < max(hi, lo + 1)
            for i, lo, hi in zip(index.tolist(), [1, 2, 3, 5, 6, 7], [2, 3, 5, 6, 7, 9], strict=True)
        ] == [True] * 6
        t = AWM().point_times(sigmas, torch.Generator().manual_seed(seed))
        assert torch.equal(t, sigmas[index])
    t = AWM(time_type="discrete").point_times(sigmas, torch.Generator().manual_seed(0))
    assert len(t) == 6 and float(t.max()) <= 1.0
    for kind in ("uniform", "logit_normal", "discrete_with_init"):
        t = AWM(time_type=kind).point_times(sigmas, torch.Generator().manual_seed(0))
        assert len(t) == 6 and bool(((t > 0) & (t <= 1)).all()), kind
    assert AWM(time_type="discrete_with_init").point_times(sigmas, torch.Generator().manual_seed(0))[0] == 1.0


def test_awm_lagged_policy_decay():
    assert [AWM().old_decay(n) for n in (0, 1, 100, 299, 300, 5000)] == pytest.approx(
        [0.0, 0.001, 0.1, 0.299, 0.3, 0.3]
    )
    assert AWM(kl_ema_decay_type="constant").old_decay(7) == 0.3


# --- DPO ----------------------------------------------------------------------------------------


def test_dpo_by_hand():
    # One pair, 2 dims, target u = ε - x0 = 0 for both (x0 = ε): errors e = mean (v - u)².
    # e_θ(w) = mean([1, 1]²) = 1, e_ref(w) = mean([1, 0]²) = 0.5, e_θ(l) = mean([0.6, 0.2]²) = 0.2,
    # e_ref(l) = mean([0.8, 0.4]²) = 0.4: inside = -β/2 ((1 - 0.5) - (0.2 - 0.4)) = -0.35 β.
    # β = 1: loss = -log σ(-0.35) = log(1 + e^0.35) = 0.883382 (dpo computes its errors in float32, as flow_grpo)
    x = [[0.3, -0.2], [0.5, 0.1]]
    batch = points(
        x0=x,
        noise=x,
        t=[0.4, 0.4],
        velocity=[[1.0, 1.0], [0.6, 0.2]],
        advantages=[1.0, -1.0],
        ref=[[1.0, 0.0], [0.8, 0.4]],
    )
    out = DPO(dpo_beta=1.0)(batch)
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(0.35)), abs=1e-7)
    assert out.metrics["implicit_acc"].item() == 0.0
    # gradient: σ(0.35) x β/2 x d(e_w - e_l)/dv: e_w' = (v - u) = [1, 1], e_l' = [0.6, 0.2] (2 (v - u) / 2)
    out.loss.backward()
    s = 1 / (1 + math.exp(-0.35))
    torch.testing.assert_close(
        batch.velocity.grad, t64([[0.5 * s, 0.5 * s], [-0.3 * s, -0.1 * s]]), rtol=1e-6, atol=1e-7
    )


def naive_dpo(batch: ForwardBatch, beta: float) -> float:
    m = len(batch.t) // 2
    total = 0.0
    for i in range(m):
        errors = []
        for row in (i, m + i):
            v, r, u = flat(batch.velocity[row]), flat(batch.ref_velocity[row]), flat(batch.target[row])
            d = len(u)
            errors.append(
                (sum((v[k] - u[k]) ** 2 for k in range(d)) / d, sum((r[k] - u[k]) ** 2 for k in range(d)) / d)
            )
        (ew, rw), (el, rl) = errors
        inside = -0.5 * beta * ((ew - rw) - (el - rl))
        total += math.log1p(math.exp(-inside))  # -log sigmoid(inside)
    return total / m


@pytest.mark.parametrize("seed, beta", [(0, 100.0), (1, 1.0), (2, 0.05)])
def test_dpo_equals_a_naive_reimplementation(seed, beta):
    batch = random_points(seed, b=8, pairwise=True)
    batch = attrs.evolve(
        batch, ref_velocity=batch.velocity.detach() + 0.01 * (batch.ref_velocity - batch.velocity.detach())
    )
    assert DPO(dpo_beta=beta)(batch).loss.item() == pytest.approx(naive_dpo(batch, beta), abs=1e-6, rel=1e-9)


def test_dpo_gradient_at_the_reference_is_a_quarter_beta_flow_matching_difference():
    """At v_θ = v_ref the inner term is 0: d loss / d v = β/4 (d e(w)/dv - d e(l)/dv) per pair."""
    batch = random_points(9, b=8, pairwise=True)
    batch = attrs.evolve(batch, ref_velocity=batch.velocity.detach().clone())
    DPO(dpo_beta=3.0)(batch).loss.backward()
    v = batch.velocity.detach().clone().requires_grad_(True)
    e = ((v - batch.target) ** 2).flatten(1).mean(1)
    (3.0 / 4 * (e[:4] - e[4:])).mean().backward()
    torch.testing.assert_close(batch.velocity.grad, v.grad, rtol=1e-5, atol=1e-7)  # float32 errors


def test_dpo_pairs_best_worst_and_all_skip_ties():
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    adv = torch.tensor([0.1, 0.9, -0.5, 0.9, 0.0, 0.0, -1.0, 1.0, 0.0])
    # group 0: first argmax 1, argmin 2; group 1 is flat (flow_grpo would pair samples 1 and 0 of it); group 2: 7 / 6
    assert DPO().pairs(adv, groups).tolist() == [[1, 2], [7, 6]]
    pairs = DPO(pairing="all").pairs(adv, groups).tolist()
    assert pairs == [[0, 2], [1, 0], [1, 2], [3, 0], [3, 2], [7, 6], [7, 8], [8, 6]]


def test_dpo_noise_levels_are_logit_normal_on_the_shifted_training_schedule():
    # u = sigmoid(N(0, 1)), index = floor(1000 u), t = shift((1000 - index) / 1000): with the generator's
    # first normal draw z, t = 3 s / (1 + 2 s), s = 1 - floor(1000 sigmoid(z)) / 1000
    sigmas = torch.linspace(1.0, 0.0, 41)
    t = DPO().point_times(sigmas, torch.Generator().manual_seed(0))
    z = torch.randn(39, generator=torch.Generator().manual_seed(0))
    s = 1 - torch.floor(1000 * torch.sigmoid(z)) / 1000
    assert len(t) == int(40 * 0.99) == 39
    torch.testing.assert_close(t, (3 * s / (1 + 2 * s)).float())


# --- decay of NFT's old policy --------------------------------------------------------------------


def test_nft_old_policy_decay_schedules():
    # return_decay: type 1 min(0.001 n, 0.5); type 2 0 for 75 steps then min(0.0075 (n - 75), 0.999); type 0 none
    assert [NFT(decay_type=1).old_decay(n) for n in (0, 1, 250, 500, 501, 10**5)] == pytest.approx(
        [0, 0.001, 0.25, 0.5, 0.5, 0.5]
    )
    assert [NFT(decay_type=2).old_decay(n) for n in (0, 74, 75, 76, 175, 208, 10**5)] == pytest.approx(
        [0, 0, 0, 0.0075, 0.75, 0.9975, 0.999]
    )
    assert {NFT(decay_type=0).old_decay(n) for n in (0, 10, 10**5)} == {0.0}


def test_nft_points_are_distinct_schedule_levels():
    sigmas = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3, 0.1, 0.0])
    t = NFT().point_times(sigmas, torch.Generator().manual_seed(3))
    assert len(t) == int(6 * 0.99) == 5 and len(set(t.tolist())) == 5 and set(t.tolist()) <= set(sigmas[:-1].tolist())


# --- conformance ----------------------------------------------------------------------------------


class TestNFTConformance(ObjectiveConformance):
    objective_name = "nft"
    objective_params = {"nft_beta": 0.5, "kl_beta": 0.01}


class TestAWMConformance(ObjectiveConformance):
    objective_name = "awm"
    objective_params = {"kl_beta": 0.001}


class TestDPOConformance(ObjectiveConformance):
    objective_name = "dpo"
    objective_params = {"dpo_beta": 10.0}
