"""DanceKernel (DanceGRPO): the conformance suite and the formula by hand.

g = eta (constant); x0_hat = x - sigma v; score = -(x - (1 - sigma) x0_hat) / sigma^2;
mu = x + dt v - eta^2/2 score dt; std = eta sqrt(-dt). Numbers worked out by hand for eta = 0.3.
"""

import torch

from fgrpo.core import registry
from fgrpo.core.testing.kernels import KernelConformance

X = torch.tensor([[0.5, -1.0]])
V = torch.tensor([[-0.2, 0.3]])


class TestDanceKernel(KernelConformance):
    kernel_name = "dance"
    kernel_params = {"eta": 0.3}


def test_default_eta():
    assert registry.create("kernel", "dance").eta == 0.3


def test_mean_and_std_by_hand():
    # sigma 0.6 -> 0.4, dt = -0.2
    # x = 0.5, v = -0.2: x0_hat = 0.62, score = -(0.5 - 0.4 * 0.62) / 0.36 = -0.7,
    #   mu = 0.5 + 0.04 - 0.045 * (-0.7) * (-0.2) = 0.5337
    # x = -1, v = 0.3: x0_hat = -1.18, score = 0.528 / 0.36, mu = -1 - 0.06 + 0.0132 = -1.0468
    k = registry.create("kernel", "dance", eta=0.3)
    out = k.step(V, X, torch.tensor([1.0, 0.6, 0.4, 0.0]), 1, noise=torch.zeros_like(X))
    torch.testing.assert_close(out.mean, torch.tensor([[0.5337, -1.0468]]))
    torch.testing.assert_close(out.std, torch.tensor([[0.1341640786]]))  # 0.3 * sqrt(0.2)


def test_sigma_one():
    # sigma = 1 -> 0.75: score = -x, mu = x + dt v + eta^2/2 x dt = 0.55 - 0.005625 for x = 0.5
    k = registry.create("kernel", "dance", eta=0.3)
    out = k.step(V, X, torch.tensor([1.0, 0.75, 0.0]), 0, noise=torch.zeros_like(X))
    torch.testing.assert_close(out.mean, torch.tensor([[0.544375, -1.06375]]))
    torch.testing.assert_close(out.std, torch.tensor([[0.15]]))


def test_tiny_sigma_stays_finite():
    # the score has 1/sigma: the kernel evaluates it with dt/sigma, bounded in [-1, 0)
    k = registry.create("kernel", "dance", eta=0.3)
    x, v = torch.full((2, 3), 5.0), torch.full((2, 3), -5.0)
    out = k.step(v, x, torch.tensor([1e-30, 1e-38, 0.0]), 0)
    assert bool(torch.isfinite(out.mean).all()) and bool(torch.isfinite(out.log_prob).all())


def test_matches_the_reference_form():
    k = registry.create("kernel", "dance", eta=0.3)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    sigma, sigma_next = 0.7, 0.2
    out = k.step(v, x, torch.tensor([0.9, sigma, sigma_next, 0.0]), 1, noise=torch.zeros_like(x))
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    dt = sigma_next - sigma
    torch.testing.assert_close(out.mean, x + dt * v - 0.5 * 0.09 * score * dt)
