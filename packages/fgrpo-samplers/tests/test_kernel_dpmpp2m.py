"""DPMpp2MKernel: conformance suite, a hand-derived two-step run, and diffusers' scheduler (for
DPMpp3MKernel too).

Flow parametrisation: alpha = 1 - sigma, x0 = x - sigma v, lambda = log(alpha / sigma).
First order: x' = (sigma'/sigma) x - alpha' (e^-h - 1) x0 (the Euler step); second order adds
-1/2 alpha' (e^-h - 1) D1 with D1 = (x0 - x0_prev) h / h_prev.
"""

import math

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.testing.kernels import KernelConformance


class TestDPMpp2MKernel(KernelConformance):
    kernel_name = "dpmpp2m"
    kernel_params = {}
    bad_params = {"eta": 0.5}  # deterministic: no noise level


def test_two_steps_by_hand():
    # sigmas 0.9 -> 0.6 -> 0.4 -> 0, x = 0.5; velocities -0.2, 0.1, -0.5 at the three steps.
    k = registry.create("kernel", "dpmpp2m")
    k.reset()
    sigmas = torch.tensor([0.9, 0.6, 0.4, 0.0])
    x = torch.tensor([[0.5]])
    # step 0 (first order = Euler): x0 = 0.5 + 0.9 * 0.2 = 0.68; x' = 0.5 + (-0.3)(-0.2) = 0.56
    x = k.step(torch.tensor([[-0.2]]), x, sigmas, 0).prev_sample
    torch.testing.assert_close(x, torch.tensor([[0.56]]))
    # step 1: x0 = 0.56 - 0.06 = 0.5; sigma'/sigma = 2/3, -alpha'(e^-h - 1) = 0.6 - 0.4 * 2/3 = 1/3
    #   first order 2/3 * 0.56 + 1/3 * 0.5 = 0.54
    #   h = log(0.6^2 / 0.4^2) = 0.8109302162, h_prev = log(0.4 * 0.9 / (0.6 * 0.1)) = log 6
    #   D1 = (0.5 - 0.68) h / h_prev = -0.0814659; x' = 0.54 + 1/2 * 1/3 * D1 = 0.5264223369
    x = k.step(torch.tensor([[0.1]]), x, sigmas, 1).prev_sample
    torch.testing.assert_close(x, torch.tensor([[0.5264223369]]))
    # step 2 to sigma' = 0: first order, x' = x0 = x - 0.4 * (-0.5)
    out = k.step(torch.tensor([[-0.5]]), x, sigmas, 2)
    torch.testing.assert_close(out.prev_sample, torch.tensor([[0.7264223369]]))
    assert torch.equal(out.std, torch.zeros(1, 1)) and torch.equal(out.log_prob, torch.zeros(1))


def test_first_step_and_mismatched_history_are_euler():
    k = registry.create("kernel", "dpmpp2m")
    ode = registry.create("kernel", "euler")
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    sigmas = torch.tensor([1.0, 0.7, 0.4, 0.2, 0.0])
    k.reset()
    torch.testing.assert_close(k.step(v, x, sigmas, 1).prev_sample, ode.step(v, x, sigmas, 1).prev_sample)
    # the history ends at 0.4; a step from 0.7 again does not continue it: first order
    torch.testing.assert_close(k.step(v, x, sigmas, 1).prev_sample, ode.step(v, x, sigmas, 1).prev_sample)
    # another batch shape: first order
    torch.testing.assert_close(
        k.step(v[:2], x[:2], sigmas, 2).prev_sample, ode.step(v[:2], x[:2], sigmas, 2).prev_sample
    )


def test_reset_forgets_the_history():
    k = registry.create("kernel", "dpmpp2m")
    g = torch.Generator().manual_seed(1)
    x, v0, v1 = (torch.randn(2, 3, generator=g) for _ in range(3))
    sigmas = torch.tensor([0.9, 0.6, 0.4, 0.0])
    k.reset()
    x1 = k.step(v0, x, sigmas, 0).prev_sample
    second = k.step(v1, x1, sigmas, 1).prev_sample
    k.reset()
    first = k.step(v1, x1, sigmas, 1).prev_sample
    assert not torch.allclose(second, first)
    torch.testing.assert_close(first, x1 + (0.4 - 0.6) * v1)


def test_per_sample_history():
    # two samples at different steps: each continues its own history
    k = registry.create("kernel", "dpmpp2m")
    sigmas = torch.tensor([0.9, 0.6, 0.4, 0.2, 0.0])
    g = torch.Generator().manual_seed(2)
    x, v0, v1 = (torch.randn(2, 3, generator=g) for _ in range(3))
    k.reset()
    mid = k.step(v0, x, sigmas, torch.tensor([0, 1])).prev_sample
    both = k.step(v1, mid, sigmas, torch.tensor([1, 2])).prev_sample
    for row, (i0, i1) in enumerate([(0, 1), (1, 2)]):
        k.reset()
        r = slice(row, row + 1)
        m = k.step(v0[r], x[r], sigmas, i0).prev_sample
        torch.testing.assert_close(k.step(v1[r], m, sigmas, i1).prev_sample, both[r])


def _velocity(x, sigma):
    # a smooth, nonlinear field so that first and second order differ
    return torch.sin(3 * x) * sigma + 0.5 * x - 0.3


def _run(kernel_name, sigmas, steps):
    k = registry.create("kernel", kernel_name)
    getattr(k, "reset", lambda: None)()
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))
    for i in range(steps):
        x = k.step(_velocity(x, sigmas[i]), x, sigmas, i).prev_sample
    return x


# (kernel, diffusers' solver_order, steps, the lower-order kernel it must differ from); 3M also on
# fewer than 15 steps, where diffusers makes the step before the final one second order
ORDERS = [("dpmpp2m", 2, 12, "ode"), ("dpmpp3m", 3, 8, "dpmpp2m"), ("dpmpp3m", 3, 20, "dpmpp2m")]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("start_at_one", [False, True])
@pytest.mark.parametrize(("kernel_name", "order", "steps", "lower"), ORDERS)
def test_matches_diffusers_dpm_solver_multistep(start_at_one, kernel_name, order, steps, lower):
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=3.0,
        solver_order=order,
        algorithm_type="dpmsolver++",
        solver_type="midpoint",
        final_sigmas_type="zero",
        lower_order_final=True,
    )
    sched.set_timesteps(steps)
    if start_at_one:  # lambda = -inf at the first step: diffusers drops the higher-order terms next
        grid = [1 - i / steps for i in range(steps + 1)]
        sched.sigmas = torch.tensor([3 * s / (1 + 2 * s) for s in grid], dtype=torch.float32)
    sigmas = sched.sigmas.clone()
    assert sigmas.shape == (steps + 1,) and float(sigmas[-1]) == 0.0
    sched.set_begin_index(0)

    k = registry.create("kernel", kernel_name)
    k.reset()
    g = torch.Generator().manual_seed(0)
    ours = theirs = torch.randn(4, 2, 3, generator=g)
    for i, t in enumerate(sched.timesteps):
        ours = k.step(_velocity(ours, sigmas[i]), ours, sigmas, i).prev_sample
        theirs = sched.step(_velocity(theirs, sigmas[i]), t, theirs).prev_sample
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=f"step {i}")
    # and the run is genuinely of that order: it differs from the lower-order run
    assert (ours - _run(lower, sigmas, steps)).abs().max() > 1e-4
    assert math.isfinite(float(ours.abs().max()))
