"""WanSDEKernel (flow_grpo's Wan 2.1 step): the conformance suite, the formula by hand, and a second
implementation written from flow_grpo's definitions (``wan_pipeline_with_logprob.py:41-84`` and the
KL of ``train_wan2_1.py:959``, upstream 879042c) on the schedule flow_grpo's Wan runs: UniPC's flow
sigmas of diffusers 0.33.1 (its pin), 20 steps, flow shift 3.
"""

import math

import numpy as np
import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.objectives._ppo import kl_term
from fgrpo.core.protocols import StepBatch
from fgrpo.core.testing.kernels import KernelConformance

X = torch.tensor([[0.5, -1.0]])
V = torch.tensor([[-0.2, 0.3]])


class TestWanSDEKernel(KernelConformance):
    kernel_name = "wan-sde"
    kernel_params = {}


class TestWanSDEKernelScaled(KernelConformance):
    kernel_name = "wan-sde"
    kernel_params = {"eta": 2.0}


def unipc_flow_sigmas_0_33(steps: int, shift: float, train_steps: int = 1000) -> torch.Tensor:
    """UniPCMultistepScheduler.set_timesteps with use_flow_sigmas in diffusers 0.33.1."""
    alphas = np.linspace(1, 1 / train_steps, steps + 1)
    sigmas = 1.0 - alphas
    sigmas = np.flip(shift * sigmas / (1 + (shift - 1) * sigmas))[:-1].copy()
    return torch.from_numpy(np.concatenate([sigmas, [0.0]]).astype(np.float32))


def flow_grpo_wan_step(sigmas, velocity, sample, index, prev_sample):
    """flow_grpo's Wan ``sde_step_with_logprob`` with ``prev_sample`` given: (log_prob, mean, std_dev_t, sqrt(-dt))."""
    sigma, sigma_prev = sigmas[index].view(-1, 1), sigmas[index + 1].view(-1, 1)
    sigma_max, sigma_min = sigmas[1].item(), sigmas[-1].item()
    dt = sigma_prev - sigma
    std_dev_t = sigma_min + (sigma_max - sigma_min) * sigma
    mean = (
        sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + velocity * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    log_prob = (
        -((prev_sample.detach() - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t, torch.sqrt(-1 * dt)


def test_default_is_flow_grpos_noise_without_a_noise_level():
    assert registry.create("kernel", "wan-sde").eta == 1.0


def test_mean_and_std_by_hand():
    # sigmas[1] = 0.75, last 0: at sigma 0.6 -> 0.4 (dt -0.2) g = 0.45, g^2/(2 sigma) = 0.16875
    # x coefficient 1 - 0.16875 * 0.2 = 0.96625; v coefficient (1 + 0.16875 * 0.4) * (-0.2) = -0.2135
    k = registry.create("kernel", "wan-sde")
    out = k.step(V, X, torch.tensor([1.0, 0.75, 0.6, 0.4, 0.0]), 2, noise=torch.ones_like(X))
    torch.testing.assert_close(out.mean, torch.tensor([[0.52582, -1.03030]]))
    std = 0.45 * math.sqrt(0.2)
    torch.testing.assert_close(out.std, torch.tensor([[std]]))
    torch.testing.assert_close(out.prev_sample, out.mean + std)
    torch.testing.assert_close(out.log_prob, torch.tensor([-0.5 - math.log(std) - 0.5 * math.log(2 * math.pi)]))


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_equals_flow_grpos_wan_step_on_its_schedule(eta):
    """Every step of the 20-step Wan schedule, per-sample indices, stored actions: the mean, the
    std g sqrt(-dt) and the log-prob equal the reference's (with eta 1; eta scales g)."""
    sigmas = unipc_flow_sigmas_0_33(20, 3.0)
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(20, 6, generator=gen), torch.randn(20, 6, generator=gen)
    index = torch.arange(20)
    k = registry.create("kernel", "wan-sde", eta=eta)
    sampled = k.step(v, x, sigmas, index, generator=gen)
    if eta == 1.0:
        ref_lp, ref_mean, ref_g, ref_sqrt_dt = flow_grpo_wan_step(sigmas, v, x, index, sampled.prev_sample)
        torch.testing.assert_close(sampled.mean, ref_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sampled.std, ref_g * ref_sqrt_dt, rtol=1e-6, atol=0)
        torch.testing.assert_close(sampled.log_prob, ref_lp, rtol=1e-5, atol=1e-5)
    else:
        g = eta * sigmas[1] * sigmas[:-1]
        torch.testing.assert_close(sampled.std.flatten(), g * torch.sqrt(sigmas[:-1] - sigmas[1:]))
    again = k.step(v, x, sigmas, index, prev_sample=sampled.prev_sample)
    assert torch.equal(again.log_prob, sampled.log_prob)


def test_kl_mean_is_flow_grpos_wan_kl():
    """flow_grpo's Wan KL: mean((mu - mu_ref)^2) / (2 (std_dev_t sqrt(-dt))^2), the exact one: kl: mean."""
    sigmas = unipc_flow_sigmas_0_33(20, 3.0)
    gen = torch.Generator().manual_seed(1)
    x, v, v_ref = (torch.randn(19, 2, 3, 4, 5, generator=gen) for _ in range(3))  # a video latent (b, c, t, h, w)
    index = torch.arange(19)  # timestep_fraction 0.99: steps 0-18
    k = registry.create("kernel", "wan-sde")
    cur = k.step(v, x, sigmas, index, noise=torch.zeros_like(x))
    ref = k.step(v_ref, x, sigmas, index, prev_sample=cur.prev_sample)
    _, _, g, sqrt_dt = flow_grpo_wan_step(sigmas, v.flatten(1), x.flatten(1), index, cur.prev_sample.flatten(1))
    expected = (
        ((cur.mean - ref.mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * (g * sqrt_dt).view(-1, 1, 1, 1, 1) ** 2)
    ).mean()
    b = x.shape[0]
    batch = StepBatch(
        log_prob=cur.log_prob,
        old_log_prob=cur.log_prob,
        advantages=torch.zeros(b),
        mean=cur.mean,
        old_mean=cur.mean,
        std=cur.std.flatten(),
        dt=(sigmas[index + 1] - sigmas[index]),
        ref_mean=ref.mean,
    )
    torch.testing.assert_close(kl_term(batch, "mean"), expected, rtol=1e-5, atol=0)


def test_sde_kernel_std_against_this_one_on_wan_schedule():
    """The figures docs/method.md gives: sde (eta 0.7) std / wan-sde std, 20 steps, shift 3."""
    sigmas = unipc_flow_sigmas_0_33(20, 3.0)
    x = torch.zeros(20, 1)
    index = torch.arange(20)
    sde = registry.create("kernel", "sde", eta=0.7).step(x, x, sigmas, index, noise=x).std.flatten()
    wan = registry.create("kernel", "wan-sde").step(x, x, sigmas, index, noise=x).std.flatten()
    ratio = sde / wan
    assert 38.5 < float(ratio[0]) < 39.5
    assert 1.42 < float(ratio[1:].min()) < 1.44 and 5.4 < float(ratio[1:].max()) < 5.45
