"""EulerKernel: the conformance suite and the Euler step by hand."""

import torch

from fgrpo.core import registry
from fgrpo.core.testing.kernels import KernelConformance


class TestEulerKernel(KernelConformance):
    kernel_name = "euler"
    kernel_params = {}
    bad_params = {"eta": 0.7}  # the ODE has no noise level: an unknown key


def test_euler_step_by_hand():
    # x' = x + (sigma' - sigma) v with sigma 0.6 -> 0.4: dt = -0.2
    k = registry.create("kernel", "euler")
    x = torch.tensor([[0.5, -1.0]])
    v = torch.tensor([[-0.2, 0.3]])
    out = k.step(v, x, torch.tensor([1.0, 0.6, 0.4, 0.0]), 1)
    torch.testing.assert_close(out.prev_sample, torch.tensor([[0.54, -1.06]]))
    assert torch.equal(out.mean, out.prev_sample)
    assert torch.equal(out.std, torch.zeros(1, 1))
    assert torch.equal(out.log_prob, torch.zeros(1))


def test_last_step_lands_on_x0_hat():
    # to sigma' = 0 the Euler step is x - sigma v, the predicted clean sample
    k = registry.create("kernel", "euler")
    x, v = torch.tensor([[0.5]]), torch.tensor([[-0.2]])
    out = k.step(v, x, torch.tensor([1.0, 0.5, 0.0]), 1)
    torch.testing.assert_close(out.prev_sample, torch.tensor([[0.6]]))


def test_given_prev_sample_is_returned_unchanged():
    k = registry.create("kernel", "euler")
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    stored = torch.randn(2, 3)
    out = k.step(v, x, torch.tensor([1.0, 0.5, 0.0]), 0, prev_sample=stored)
    assert torch.equal(out.prev_sample, stored)
    torch.testing.assert_close(out.mean, x - 0.5 * v)
