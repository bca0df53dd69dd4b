"""CPSKernel (coefficients-preserving sampling): conformance suite and the formula by hand.

std = sigma' sin(eta pi/2); x0_hat = x - sigma v; x1_hat = x + (1 - sigma) v;
mu = (1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) x1_hat. Numbers worked out by hand, eta = 0.8:
sin(0.4 pi) = 0.9510565163, cos(0.4 pi) = 0.3090169944.
"""

import math

import torch

from fgrpo.core import registry
from fgrpo.core.testing.kernels import KernelConformance

X = torch.tensor([[0.5, -1.0]])
V = torch.tensor([[-0.2, 0.3]])


class TestCPSKernelNormalized(KernelConformance):
    """The exact Gaussian density: every check of the suite."""

    kernel_name = "cps"
    kernel_params = {"eta": 0.8, "normalized_logprob": True}


class TestCPSKernelReference(KernelConformance):
    """The default: the reference implementations' unnormalised -(x' - mu)^2."""

    kernel_name = "cps"
    kernel_params = {}
    bad_params = {"eta": 1.5}  # eta is a fraction of a quarter turn: [0, 1]

    def expected_log_prob(self, prev_sample, mean, std):
        lp = -((prev_sample.double() - mean.double()) ** 2)
        return lp.reshape(lp.shape[0], -1).mean(dim=1)


def test_defaults():
    k = registry.create("kernel", "cps")
    assert k.eta == 0.8 and k.normalized_logprob is False


def test_mean_and_std_by_hand():
    # sigma 0.6 -> 0.4: std = 0.4 * 0.9510565163; sqrt(sigma'^2 - std^2) = 0.4 * 0.3090169944
    # x = 0.5, v = -0.2: x0_hat = 0.62, x1_hat = 0.42: mu = 0.372 + 0.42 * 0.1236067977
    # x = -1, v = 0.3: x0_hat = -1.18, x1_hat = -0.88: mu = -0.708 - 0.88 * 0.1236067977
    k = registry.create("kernel", "cps", eta=0.8)
    delta = torch.tensor([[0.1, -0.3]])
    mean = torch.tensor([[0.4239148551, -0.8167739820]])
    out = k.step(V, X, torch.tensor([1.0, 0.6, 0.4, 0.0]), 1, prev_sample=mean + delta)
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, torch.tensor([[0.3804226065]]))
    # unnormalised log-prob: -mean(delta^2) = -(0.01 + 0.09) / 2
    torch.testing.assert_close(out.log_prob, torch.tensor([-0.05]))


def test_normalized_log_prob_by_hand():
    k = registry.create("kernel", "cps", eta=0.8, normalized_logprob=True)
    out = k.step(V, X, torch.tensor([1.0, 0.6, 0.4, 0.0]), 1, noise=torch.ones_like(X))
    # x' = mu + std: -1/2 - log(0.3804226065) - log(2 pi)/2 = -0.4524660114
    torch.testing.assert_close(out.log_prob, torch.tensor([-0.4524660114]))


def test_last_step_is_deterministic_and_flagged():
    # sigma' = 0: std = 0, x' = mu = x0_hat = x - sigma v (0.5 + 0.5 * 0.2 = 0.6), log-prob 0
    for normalized in (False, True):
        k = registry.create("kernel", "cps", eta=0.8, normalized_logprob=normalized)
        out = k.step(V, X, torch.tensor([1.0, 0.5, 0.0]), 1, generator=torch.Generator().manual_seed(0))
        assert torch.equal(out.std, torch.zeros(1, 1))  # the flag samplers check: never train it
        torch.testing.assert_close(out.prev_sample, torch.tensor([[0.6, -1.15]]))
        assert torch.equal(out.prev_sample, out.mean)
        assert torch.equal(out.log_prob, torch.zeros(1))
        off = k.step(V, X, torch.tensor([1.0, 0.5, 0.0]), 1, prev_sample=X)
        assert torch.equal(off.log_prob, torch.zeros(1))


def test_eta_zero_is_the_euler_step():
    k = registry.create("kernel", "cps", eta=0.0)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    out = k.step(v, x, torch.tensor([1.0, 0.7, 0.3, 0.0]), 1)
    torch.testing.assert_close(out.prev_sample, x + (0.3 - 0.7) * v)


def test_eta_one_drops_the_noise_estimate():
    # std = sigma', sqrt(sigma'^2 - std^2) = 0: mu = (1 - sigma') x0_hat
    k = registry.create("kernel", "cps", eta=1.0)
    out = k.step(V, X, torch.tensor([1.0, 0.6, 0.4, 0.0]), 1, noise=torch.zeros_like(X))
    torch.testing.assert_close(out.std, torch.tensor([[0.4]]))
    torch.testing.assert_close(out.mean, 0.6 * (X - 0.6 * V))


def test_coefficients_are_preserved():
    # with exact x0_hat, x1_hat (x = (1 - sigma) x0 + sigma eps, v = eps - x0) the sample is
    # (1 - sigma') x0 + sigma' (cos eps + sin eps'), i.e. again x0 and unit noise at level sigma'
    k = registry.create("kernel", "cps", eta=0.8)
    g = torch.Generator().manual_seed(1)
    x0, eps, fresh = (torch.randn(3, 4, generator=g) for _ in range(3))
    sigma, sigma_next = 0.6, 0.4
    x = (1 - sigma) * x0 + sigma * eps
    out = k.step(eps - x0, x, torch.tensor([1.0, sigma, sigma_next, 0.0]), 1, noise=fresh)
    c, s = math.cos(0.4 * math.pi), math.sin(0.4 * math.pi)
    torch.testing.assert_close(out.prev_sample, (1 - sigma_next) * x0 + sigma_next * (c * eps + s * fresh))
