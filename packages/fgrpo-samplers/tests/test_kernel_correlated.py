"""The correlated kernel: the shared kernel conformance (with its own density), the exact
log-prob against torch's MultivariateNormal, the noise's covariance, and the exact KL of
whitened means."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.testing import KernelConformance
from fgrpo.samplers.kernels.correlated import correlation_factor


def _covariance(steps: int, length: float, white: float, growth: float) -> torch.Tensor:
    k = torch.arange(steps, dtype=torch.float64)
    r = (1 - white) * torch.exp(-((k[:, None] - k[None]) ** 2) / (2 * length**2)) + white * torch.eye(
        steps, dtype=torch.float64
    )
    s = ((k + 1) / steps) ** growth
    s = s / s.pow(2).mean().sqrt()
    return s[:, None] * r * s[None]


class TestCorrelated(KernelConformance):
    kernel_name = "correlated"
    kernel_params = {"base": {"name": "sde", "eta": 0.7}, "length": 1.5, "growth": 1.0}
    bad_params = {"length": -1.0}
    shapes = ((4, 8, 2), (3, 5, 3))

    def expected_log_prob(self, prev_sample, mean, std):
        """The density under N(mean, std^2 C) along the time axis (-2), per coordinate, averaged."""
        params = self.kernel_params
        steps = mean.shape[-2]
        cov = _covariance(steps, params["length"], 0.05, params["growth"])
        out = []
        for b in range(mean.shape[0]):
            s = std[b].double().reshape(())
            dist = torch.distributions.MultivariateNormal(mean[b].double().T, covariance_matrix=s**2 * cov)
            out.append(dist.log_prob(prev_sample[b].double().T).sum() / mean[b].numel())
        return torch.stack(out)

    def test_noise_override(self):
        kernel, velocity, sample, sigmas, index = self.one_step(seed=4)
        noise = torch.randn(self.shapes[0], generator=torch.Generator().manual_seed(5))
        a = self.step(kernel, velocity, sample, sigmas, index, noise=noise)
        lower = kernel.factor(noise.shape[-2], noise.device)
        torch.testing.assert_close(a.prev_sample, a.mean + a.std * (lower @ noise))  # shaped noise along time


def test_the_noise_has_the_covariance_it_says():
    kernel = registry.create("kernel", "correlated", base={"name": "cps", "eta": 0.8}, length=2.0, growth=0.5)
    n, steps = 40000, 8
    x = torch.zeros(n, steps, 1)
    sigmas = torch.tensor([1.0, 0.6, 0.3, 0.0])
    out = kernel.step(torch.zeros_like(x), x, sigmas, 1, generator=torch.Generator().manual_seed(0))
    noise = ((out.prev_sample - out.mean) / out.std)[..., 0]
    empirical = noise.T.double() @ noise.double() / n
    torch.testing.assert_close(empirical, _covariance(steps, 2.0, 0.05, 0.5), rtol=0, atol=0.03)
    # neighbours move together: a candidate plan is smooth, its second differences small
    independent = torch.randn(n, steps, generator=torch.Generator().manual_seed(1))
    assert noise.diff(n=2, dim=1).pow(2).mean() < 0.2 * independent.diff(n=2, dim=1).pow(2).mean()


def test_whitened_means_give_the_exact_kl():
    kernel = registry.create("kernel", "correlated", base={"name": "sde", "eta": 0.7}, length=1.5)
    g = torch.Generator().manual_seed(3)
    mu1, mu2 = torch.randn(2, 6, 2, generator=g), torch.randn(2, 6, 2, generator=g)
    std = 0.3
    cov = _covariance(6, 1.5, 0.05, 0.0) * std**2
    for b in range(2):
        p = torch.distributions.MultivariateNormal(mu1[b].double().T, covariance_matrix=cov)
        q = torch.distributions.MultivariateNormal(mu2[b].double().T, covariance_matrix=cov)
        exact = torch.distributions.kl_divergence(p, q).sum() / mu1[b].numel()
        ours = (kernel.whiten(mu1[b : b + 1]) - kernel.whiten(mu2[b : b + 1])).pow(2).mean() / (2 * std**2)
        assert ours.item() == pytest.approx(exact.item(), rel=1e-5)


def test_length_zero_is_the_base_kernel():
    base = registry.create("kernel", "sde", eta=0.7)
    same = registry.create("kernel", "correlated", base={"name": "sde", "eta": 0.7}, length=0.0)
    x, v = torch.randn(3, 8, 2, generator=torch.Generator().manual_seed(0)), torch.randn(3, 8, 2)
    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.0])
    noise = torch.randn(3, 8, 2, generator=torch.Generator().manual_seed(2))
    a, b = base.step(v, x, sigmas, 1, noise=noise), same.step(v, x, sigmas, 1, noise=noise)
    torch.testing.assert_close(a.prev_sample, b.prev_sample)
    torch.testing.assert_close(a.log_prob, b.log_prob)
    assert torch.equal(correlation_factor(4, 0.0, 0.05, 0.0), torch.eye(4, dtype=torch.float64))
    assert math.isclose(float(correlation_factor(4, 1.0, 0.05, 0.0)[0, 0]), 1.0)
