"""SDEKernel (Flow-GRPO): the conformance suite and the formula by hand.

g = eta sqrt(sigma / (1 - sigma)); mu = x (1 + g^2/(2 sigma) dt) + v (1 + g^2 (1 - sigma)/(2 sigma)) dt;
std = g sqrt(-dt). The numbers below were worked out by hand for eta = 0.7.
"""

import math

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.testing.kernels import KernelConformance

X = torch.tensor([[0.5, -1.0]])
V = torch.tensor([[-0.2, 0.3]])
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class TestSDEKernel(KernelConformance):
    kernel_name = "sde"
    kernel_params = {"eta": 0.7}


class TestSDEKernelStrongNoise(KernelConformance):
    kernel_name = "sde"
    kernel_params = {"eta": 1.5}


def test_default_eta():
    assert registry.create("kernel", "sde").eta == 0.7


def test_mean_and_std_by_hand():
    # sigma 0.6 -> 0.4, dt = -0.2: g^2 = 0.49 * 0.6 / 0.4 = 0.735
    # x coefficient 1 + 0.735 / 1.2 * (-0.2) = 0.8775; v coefficient (1 + 0.735 * 0.4 / 1.2) * (-0.2) = -0.249
    k = registry.create("kernel", "sde", eta=0.7)
    out = k.step(V, X, torch.tensor([1.0, 0.6, 0.4, 0.0]), 1, noise=torch.ones_like(X))
    torch.testing.assert_close(out.mean, torch.tensor([[0.48855, -0.9522]]))
    std = math.sqrt(0.735 * 0.2)  # 0.3834057903
    torch.testing.assert_close(out.std, torch.tensor([[std]]))
    torch.testing.assert_close(out.prev_sample, out.mean + std)
    # x' = mu + std in every dimension: log p = -1/2 - log(std) - log(2 pi)/2 = -0.4602771871
    torch.testing.assert_close(out.log_prob, torch.tensor([-0.4602771871]))


def test_sigma_one_uses_sigmas_1_in_the_denominator():
    # sigma = 1 -> 0.75: g^2 = 0.49 / (1 - 0.75) = 1.96, std = 1.4 * sqrt(0.25) = 0.7;
    # x coefficient 1 - 1.96/2 * 0.25 = 0.755; v coefficient (1 + 0) * (-0.25)
    k = registry.create("kernel", "sde", eta=0.7)
    out = k.step(V, X, torch.tensor([1.0, 0.75, 0.5, 0.0]), 0, noise=torch.zeros_like(X))
    torch.testing.assert_close(out.std, torch.tensor([[0.7]]))
    torch.testing.assert_close(out.mean, torch.tensor([[0.4275, -0.83]]))
    torch.testing.assert_close(out.prev_sample, out.mean)


def test_last_step_to_zero():
    # sigma 0.5 -> 0: g = 0.7, std = 0.7 sqrt(0.5); coefficients 0.755 and 1.245 * (-0.5)
    k = registry.create("kernel", "sde", eta=0.7)
    out = k.step(V, X, torch.tensor([1.0, 0.75, 0.5, 0.0]), 2, noise=torch.zeros_like(X))
    torch.testing.assert_close(out.std, torch.tensor([[0.7 * math.sqrt(0.5)]]))
    torch.testing.assert_close(out.mean, torch.tensor([[0.502, -0.94175]]))


def test_eta_zero_is_the_euler_step():
    k = registry.create("kernel", "sde", eta=0.0)
    sigmas = torch.tensor([1.0, 0.6, 0.4, 0.0])
    out = k.step(V, X, sigmas, 1)
    torch.testing.assert_close(out.prev_sample, X + (0.4 - 0.6) * V)
    assert torch.equal(out.log_prob, torch.zeros(1)) and torch.equal(out.std, torch.zeros(1, 1))


def test_matches_the_unfused_reference_form():
    # mu = x + v dt + g^2/(2 sigma) (x + (1 - sigma) v) dt: ODE drift plus the score correction
    k = registry.create("kernel", "sde", eta=0.7)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    sigmas = torch.tensor([0.9, 0.7, 0.2, 0.0])
    out = k.step(v, x, sigmas, 1, noise=torch.zeros_like(x))
    sigma, dt = 0.7, 0.2 - 0.7
    g2 = 0.49 * sigma / (1 - sigma)
    torch.testing.assert_close(out.mean, x + v * dt + g2 / (2 * sigma) * (x + (1 - sigma) * v) * dt)


def test_noise_and_prev_sample_together_are_refused():
    k = registry.create("kernel", "sde")
    with pytest.raises(ValueError, match="at most one"):
        k.step(V, X, torch.tensor([1.0, 0.5, 0.0]), 0, noise=torch.zeros_like(X), prev_sample=X)


def test_sigmas_on_another_dtype_and_a_bf16_action():
    # float64 sigmas are used as float32; a stored bf16 action is evaluated as its float32 value
    k = registry.create("kernel", "sde")
    sigmas = torch.tensor([1.0, 0.6, 0.4, 0.0], dtype=torch.float64)
    action = (X + 0.1).to(torch.bfloat16)
    a = k.step(V, X, sigmas, 1, prev_sample=action)
    b = k.step(V, X, sigmas.float(), 1, prev_sample=action.float())
    assert torch.equal(a.log_prob, b.log_prob) and a.log_prob.dtype == torch.float32
