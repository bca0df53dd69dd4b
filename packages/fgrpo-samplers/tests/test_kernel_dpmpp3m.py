"""DPMpp3MKernel: conformance suite, a hand computation of one third-order step; its match with
diffusers' third-order multistep scheduler is in test_kernel_dpmpp2m.py."""

import math

import torch

from fgrpo.core import registry
from fgrpo.core.testing.kernels import KernelConformance


class TestDPMpp3MKernel(KernelConformance):
    kernel_name = "dpmpp3m"
    kernel_params = {}
    bad_params = {"eta": 0.5}  # deterministic: no noise level


def _lam(s):
    return math.log((1 - s) / s)


def test_third_step_by_hand():
    # sigmas 0.9 -> 0.7 -> 0.5 -> 0.3 -> 0.1 -> 0 (5 steps < 15: step 3 is second order, step 4 first)
    sigmas = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.1, 0.0])
    k = registry.create("kernel", "dpmpp3m")
    k.reset()
    x = torch.tensor([[0.4]])
    vs = [-0.3, 0.2, -0.1]
    x0s = []
    for i, v in enumerate(vs):
        x0s.append(float(x) - float(sigmas[i]) * v)
        before = float(x)
        x = k.step(torch.tensor([[v]]), x, sigmas, i).prev_sample
    # step 2 by hand: m0, m1, m2 = x0 at sigma 0.5, 0.7, 0.9
    s_t, s0, s1, s2 = 0.3, 0.5, 0.7, 0.9
    h, h0, h1 = _lam(s_t) - _lam(s0), _lam(s0) - _lam(s1), _lam(s1) - _lam(s2)
    r0, r1 = h0 / h, h1 / h
    m0, m1, m2 = x0s[2], x0s[1], x0s[0]
    d1_0, d1_1 = (m0 - m1) / r0, (m1 - m2) / r1
    d1 = d1_0 + r0 / (r0 + r1) * (d1_0 - d1_1)
    d2 = (d1_0 - d1_1) / (r0 + r1)
    a_t = 1 - s_t
    expected = (
        s_t / s0 * before
        - a_t * (math.exp(-h) - 1) * m0
        + a_t * ((math.exp(-h) - 1) / h + 1) * d1
        - a_t * ((math.exp(-h) - 1 + h) / h**2 - 0.5) * d2
    )
    torch.testing.assert_close(x, torch.tensor([[expected]]), rtol=1e-6, atol=1e-6)


def test_broken_history_restarts_at_first_order():
    k = registry.create("kernel", "dpmpp3m")
    ode = registry.create("kernel", "euler")
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.2, 0.0])
    k.reset()
    k.step(v, x, sigmas, 0)
    k.step(v, x, sigmas, 1)
    # another batch shape: the history does not continue
    torch.testing.assert_close(
        k.step(v[:2], x[:2], sigmas, 2).prev_sample, ode.step(v[:2], x[:2], sigmas, 2).prev_sample
    )
