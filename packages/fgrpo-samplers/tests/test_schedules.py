"""Sigma schedules: values by hand, diffusers' FlowMatchEulerDiscreteScheduler, and the checks."""

import math

import numpy as np
import pytest
import torch

from fgrpo.core.config import check_params
from fgrpo.samplers import schedules
from fgrpo.samplers.schedules import Schedule, check_sigmas, explicit, flux_mu, flux_shift, linear, time_shift


def test_linear():
    s = linear(4)
    assert s.dtype == torch.float32
    assert s.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert linear(1).tolist() == [1.0, 0.0]
    for bad in (0, -3, 2.5, True, "4"):
        with pytest.raises(ValueError, match="steps"):
            linear(bad)


def test_time_shift_by_hand():
    # s = 3: 0.5 -> 1.5 / 2 = 0.75, 0.25 -> 0.75 / 1.5 = 0.5, 0.75 -> 2.25 / 2.5 = 0.9; 0 and 1 stay
    out = time_shift(linear(4), 3.0)
    torch.testing.assert_close(out, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))
    assert torch.equal(time_shift(linear(4), 1.0), linear(4))
    with pytest.raises(ValueError, match="shift"):
        time_shift(linear(4), 0.0)


def test_flux_mu_and_shift_by_hand():
    assert flux_mu(256) == pytest.approx(0.5)
    assert flux_mu(4096) == pytest.approx(1.15)
    assert flux_mu(1024) == pytest.approx(0.5 + 0.65 * 768 / 3840)
    out = flux_shift(linear(2), 4096)
    e = math.exp(1.15)
    torch.testing.assert_close(out, torch.tensor([1.0, e / (e + 1.0), 0.0]))
    assert out[-1].item() == 0.0 and out.dtype == torch.float32
    # equivalent to the SD3 shift with s = e^mu
    torch.testing.assert_close(flux_shift(linear(10), 1024), time_shift(linear(10), math.exp(flux_mu(1024))))


@pytest.mark.parametrize("steps", [1, 10, 28])
@pytest.mark.parametrize("shift", [1.0, 3.0, 7.5])
def test_time_shift_matches_diffusers(steps, shift):
    diffusers = pytest.importorskip("diffusers")
    sched = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    # SD3-style pipelines pass sigmas = linspace(1, 1/N, N); the scheduler shifts and appends 0
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
    torch.testing.assert_close(time_shift(linear(steps), shift), sched.sigmas.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("seq_len", [256, 1024, 4096, 6000])
def test_flux_shift_matches_diffusers(seq_len):
    diffusers = pytest.importorskip("diffusers")
    steps = 20
    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
    )
    # diffusers' calculate_shift (pipeline_flux): m = (1.15 - 0.5) / (4096 - 256), mu = seq_len m + 0.5 - 256 m
    m = (1.15 - 0.5) / (4096 - 256)
    mu = seq_len * m + 0.5 - 256 * m
    assert flux_mu(seq_len) == pytest.approx(mu)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    torch.testing.assert_close(flux_shift(linear(steps), seq_len), sched.sigmas.float(), atol=1e-6, rtol=0)


def test_explicit():
    s = explicit([1.0, 0.5, 0.1, 0.0])
    assert s.dtype == torch.float32 and s.tolist() == pytest.approx([1.0, 0.5, 0.1, 0.0])
    assert explicit(torch.tensor([0.9, 0.2], dtype=torch.float64)).dtype == torch.float32
    with pytest.raises(ValueError, match="values"):
        explicit(["a", 0.0])
    with pytest.raises(ValueError, match="decreasing"):
        explicit([1.0, 0.5, 0.5, 0.0])


@pytest.mark.parametrize(
    "values, words",
    [
        (torch.tensor([[1.0, 0.0]]), ["1-D", "(1, 2)"]),
        (torch.tensor([1.0]), ["at least 2", "1"]),
        (torch.tensor([1, 0]), ["floating", "int64"]),
        (torch.tensor([1.0, float("nan"), 0.0]), ["finite", "sigmas[1] = nan"]),
        (torch.tensor([1.0, float("inf")]), ["finite", "sigmas[1] = inf"]),
        (torch.tensor([1.2, 0.5, 0.0]), ["[0, 1]", "sigmas[0] = 1.2"]),
        (torch.tensor([1.0, 0.5, -0.1]), ["[0, 1]", "sigmas[2] = -0.1"]),
        (torch.tensor([1.0, 0.4, 0.6, 0.0]), ["decreasing", "sigmas[2] = 0.6"]),
        ([1.0, 0.0], ["tensor", "list"]),
    ],
)
def test_check_sigmas_errors(values, words):
    with pytest.raises(ValueError) as info:
        check_sigmas(values)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_check_sigmas_accepts_valid_schedules():
    for s in (linear(5), time_shift(linear(30), 3.0), flux_shift(linear(7), 999), torch.tensor([0.8, 0.3])):
        assert check_sigmas(s) is s


def test_schedule_config():
    assert Schedule().type == "shift" and Schedule().shift == 3.0
    torch.testing.assert_close(Schedule()(4), torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]))
    assert Schedule(type="linear")(4).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    torch.testing.assert_close(Schedule(type="flux", image_seq_len=1024)(6), flux_shift(linear(6), 1024))
    torch.testing.assert_close(Schedule(type="explicit", values=[1.0, 0.6, 0.0])(2), torch.tensor([1.0, 0.6, 0.0]))
    for schedule in (Schedule(), Schedule(type="linear"), Schedule(type="flux", image_seq_len=64)):
        for steps in (1, 2, 10, 50):
            s = schedule(steps)
            assert s.shape == (steps + 1,) and s.dtype == torch.float32
            assert s[0].item() == 1.0 and s[-1].item() == 0.0


def test_schedule_config_errors():
    with pytest.raises(ValueError, match="image_seq_len"):
        Schedule(type="flux")
    with pytest.raises(ValueError, match="values"):
        Schedule(type="explicit")
    with pytest.raises(ValueError, match="expected steps"):
        Schedule(type="explicit", values=[1.0, 0.5, 0.0])(4)
    with pytest.raises(ValueError):
        Schedule(shift=-1.0)
    with pytest.raises(ValueError):
        Schedule(type="cosine")


def test_schedule_recipe_keys():
    # the recipe loader checks keys without building: every problem at once
    _, errors = check_params(Schedule, {"type": "cosine", "shift": 0, "image_seq_len": 0, "steps": 3})
    keys = sorted(e.key for e in errors)
    assert keys == ["image_seq_len", "shift", "steps", "type"], errors
    checked, errors = check_params(Schedule, {"type": "shift", "shift": "2.5"})
    assert not errors and checked["shift"] == 2.5


def test_module_exports():
    for name in ("linear", "time_shift", "flux_shift", "explicit", "check_sigmas", "Schedule"):
        assert hasattr(schedules, name)
