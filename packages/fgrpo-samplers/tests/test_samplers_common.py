"""What every group sampler (full, fast, mixgrpo) must do, with the real kernels."""

from __future__ import annotations

import importlib

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.config import RecipeError, check_params
from fgrpo.core.testing import GaussianPolicy, SamplerConformance

PROMPTS = ["a red circle", "a blue square"]
GROUP = 3
BATCH = len(PROMPTS) * GROUP


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Every built-in sampler passes the conformance base (trajectory shapes and dtypes, bit-identical
# re-evaluation of the stored log-probs, seeds, NFE, state round trip); together these cover every
# kernel and every way of choosing steps.


class TestFull(SamplerConformance):
    sampler_name = "full"
    sampler_params = {"steps": 6}


class TestFullDanceRandomSubset(SamplerConformance):
    sampler_name = "full"
    sampler_params = {
        "steps": 6,
        "timestep_fraction": 0.5,
        "random_subset": True,
        "kernel": {"name": "dance", "eta": 0.3},
    }


class TestFullPrefGRPO(SamplerConformance):
    """Pref-GRPO's FLUX choice: shared initial noise, a random 60% of all steps but the last."""

    sampler_name = "full"
    sampler_params = {
        "steps": 6,
        "timestep_fraction": 0.6,
        "random_subset": True,
        "ignore_last": True,
        "share_noise": True,
        "final": "x0",
    }


class TestFullCPSSharedNoise(SamplerConformance):
    sampler_name = "full"
    sampler_params = {"steps": 6, "kernel": "cps", "share_noise": True}


class TestFast(SamplerConformance):
    sampler_name = "fast"
    sampler_params = {"steps": 6, "window": 2}


class TestFastSharedPrefix(SamplerConformance):
    sampler_name = "fast"
    sampler_params = {"steps": 6, "window": 2, "share_noise": True}


class TestFastCPSPrefixPerSample(SamplerConformance):
    sampler_name = "fast"
    sampler_params = {"steps": 6, "window": 3, "share_noise": True, "share_prefix": False, "kernel": "cps"}


class TestMixGRPO(SamplerConformance):
    sampler_name = "mixgrpo"
    sampler_params = {"steps": 8, "window": 2}


class TestMixGRPOFlashDance(SamplerConformance):
    sampler_name = "mixgrpo"
    sampler_params = {"steps": 8, "window": 2, "flash": True, "kernel": "dance"}


class TestMixGRPORandomFlash3(SamplerConformance):
    sampler_name = "mixgrpo"
    sampler_params = {
        "steps": 10,
        "window": 2,
        "strategy": "random",
        "shift_every": 2,
        "flash": True,
        "flash_order": 3,
    }


# NFE = sum over velocity calls of rows x evaluations_per_call; P = 2 prompts, G = 3, B = 6.
NFE_CASES = [
    # every step at batch B: 8 steps x 6
    ("full", {"steps": 8}, None, 48),
    ("full", {"steps": 8, "timestep_fraction": 0.5}, None, 48),
    # window at 3: prefix 3 steps x P=2 (shared), then 5 steps x 6  ->  6 + 30
    ("fast", {"steps": 8, "window_range": [3, 5], "share_noise": True}, None, 36),
    # the same recomputing the prefix per sample: 8 x 6
    ("fast", {"steps": 8, "window_range": [3, 5], "share_noise": True, "share_prefix": False}, None, 48),
    ("fast", {"steps": 8, "window_range": [3, 5]}, None, 48),  # independent noise: no shared prefix
    # window [0, 2): nothing before it -> 8 x 6
    ("mixgrpo", {"steps": 8, "window": 2}, 0, 48),
    # iteration 50 with shift_every 25 -> window [2, 4): prefix 2 x 2 + 6 x 6
    ("mixgrpo", {"steps": 8, "window": 2}, 50, 40),
    # flash, window [2, 4): prefix 2 x 2, window 2 x 6, then int((8 - 3) * 0.4) = 2 points = 1 step x 6
    ("mixgrpo", {"steps": 8, "window": 2, "flash": True}, 50, 22),
    # 25 steps, window [0, 4), flash: 4 x 6 + (int((25 - 3) * 0.4) = 8 points -> 7 steps) x 6
    ("mixgrpo", {"steps": 25, "window": 4, "flash": True}, 0, 66),
]


@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "cfg"])
@pytest.mark.parametrize(("name", "keys", "iteration", "expected"), NFE_CASES)
def test_nfe(make_policy, name, keys, iteration, expected, cfg):
    policy = make_policy(guidance=4.5 if cfg else None)
    sampler = registry.create("sampler", name, **keys)
    if iteration is not None:
        sampler.advance(iteration)
    traj = sampler.rollout(policy, PROMPTS, GROUP, generator=gen())
    factor = 2 if cfg else 1
    assert traj.nfe == expected * factor
    assert sum(policy.rows) * factor == traj.nfe
    assert traj.info["nfe_per_sample"] == pytest.approx(expected * factor / BATCH)


def test_registry_builds_nested_kernel_and_rejects_bad_keys():
    sampler = registry.create("sampler", "mixgrpo", kernel={"name": "sde", "eta": 0.7}, steps=25, flash=True)
    assert type(sampler).__name__ == "MixGRPOSampler" and sampler.kernel.eta == 0.7

    with pytest.raises(RecipeError) as bad:
        registry.create("sampler", "mixgrpo", windw=3, strategy="sometimes", kernel={"name": "sde", "eta": -1})
    keys = {e.key for e in bad.value.errors}
    assert keys == {"sampler.windw", "sampler.strategy", "sampler.kernel.eta"}
    assert "did you mean 'window'" in str(bad.value)

    for name, keys, key in CROSS_KEY_ERRORS + [
        ("full", {"timestep_fraction": 1.5}, "sampler.timestep_fraction"),
        ("mixgrpo", {"at_end": "wrap"}, "sampler.at_end"),
        ("mixgrpo", {"schedule": {"type": "cosine"}}, "sampler.schedule"),
    ]:
        with pytest.raises(RecipeError) as bad:
            registry.create("sampler", name, **keys)
        assert [e.key for e in bad.value.errors] == [key], (name, keys)


# errors that involve several keys: raised when building, and reported by check_keys without building
CROSS_KEY_ERRORS = [
    ("full", {"kernel": "euler"}, "sampler.kernel"),  # a deterministic kernel cannot be trained
    ("fast", {"kernel": {"name": "dpmpp2m"}}, "sampler.kernel"),
    ("full", {"timestep_fraction": 0.05}, "sampler.timestep_fraction"),  # int(10 * 0.05) = 0
    ("fast", {"window": 11}, "sampler.window"),
    ("fast", {"window_range": [3, 4]}, "sampler.window_range"),  # the window of 2 does not fit
    ("fast", {"window_range": [0, 11]}, "sampler.window_range"),  # past the last step
    ("mixgrpo", {"window_end": 3}, "sampler.window_end"),  # window 4 does not fit in [0, 3)
    ("mixgrpo", {"steps": 5}, "sampler.window"),  # window 4 does not fit in [0, 5 - 2)
]


@pytest.mark.parametrize(("name", "keys", "key"), CROSS_KEY_ERRORS)
def test_check_keys_reports_cross_key_errors_without_building(name, keys, key):
    cls = registry.load("sampler", name)
    # check_params runs the component's cross-key rules after the per-key checks
    _, errors = check_params(cls, keys, "sampler")
    assert [e.key for e in errors] == [key]
    assert check_params(cls, {}, "sampler")[1] == []


def test_schedule_key(policy):
    sampler = registry.create("sampler", "full", steps=4, schedule={"type": "linear"})
    traj = sampler.rollout(policy, PROMPTS[:1], 2, generator=gen())
    assert traj.sigmas.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    default = registry.create("sampler", "full", steps=4).rollout(policy, PROMPTS[:1], 2, generator=gen())
    assert torch.equal(default.sigmas, policy.sigmas(4))


# --- a plugin that registers a built-in kernel's name ---------------------------------------------

PLUGIN = '''
import attrs, torch
from typing import ClassVar
from fgrpo.samplers.kernels.base import KernelBase


@attrs.define
class Overshoot(KernelBase):
    """A third party's deterministic kernel: twice the Euler step."""

    stochastic: ClassVar[bool] = False

    def transition(self, s):
        return s.sample + 2 * s.dt * s.velocity, None
'''


def install_overshoot(tmp_path, monkeypatch):
    """A distribution that registers its kernel as ``euler``, ``dpmpp2m`` and ``dpmpp3m``."""
    (tmp_path / "overshoot_kernels.py").write_text(PLUGIN)
    info = tmp_path / "overshoot_kernels-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: overshoot-kernels\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fgrpo.kernels]\n" + "".join(f"{n} = overshoot_kernels:Overshoot\n" for n in ("euler", "dpmpp2m", "dpmpp3m"))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_loaded", {})


PLUGIN_CASES = [
    ("fast", {"steps": 8, "window_range": [3, 5], "share_noise": True}, None),
    ("fast", {"steps": 8, "window_range": [3, 5], "final": "ode"}, None),
    ("mixgrpo", {"steps": 8, "window": 2, "flash": True}, 50),
    ("mixgrpo", {"steps": 12, "window": 2, "flash": True, "flash_order": 3, "flash_ratio": 0.8}, 50),
]


@pytest.mark.parametrize("how", ["beside", "instead"])
@pytest.mark.parametrize(("name", "keys", "iteration"), PLUGIN_CASES)
def test_a_plugin_registering_euler_does_not_change_the_builtin_samplers(
    tmp_path, monkeypatch, how, name, keys, iteration
):
    """The Euler prefix/suffix and the Flash solver are the built-in kernels, whatever is registered
    under their names: ``beside`` = the plugin and fgrpo-samplers both register ``euler`` (a recipe
    naming it is refused as ambiguous); ``instead`` = the name resolves to the plugin's kernel."""

    def rollout():
        sampler = registry.create("sampler", name, **keys)
        if iteration is not None:
            sampler.advance(iteration)
        return sampler.rollout(GaussianPolicy(), PROMPTS, GROUP, generator=gen(5))

    before = rollout()
    install_overshoot(tmp_path, monkeypatch)
    if how == "beside":
        with pytest.raises(registry.AmbiguousComponent, match="overshoot-kernels"):
            registry.create("kernel", "euler")
    else:
        overshoot = importlib.import_module("overshoot_kernels").Overshoot
        for kernel in ("euler", "dpmpp2m", "dpmpp3m"):
            registry._loaded[("kernel", kernel)] = overshoot
        assert type(registry.create("kernel", "euler")).__name__ == "Overshoot"  # the name is the plugin's now
    after = rollout()
    start = before.info["window_start"]
    assert after.info["window_start"] == start and start > 0
    # the state at the window start is the built-in Euler prefix's result, the rest follows from it
    assert torch.equal(after.latents[:, 0], before.latents[:, 0])
    for field in ("latents", "next_latents", "log_probs", "means", "final"):
        assert torch.equal(getattr(after, field), getattr(before, field)), field
    assert after.info["nfe"] == before.info["nfe"]


class TestODEEuler(SamplerConformance):
    sampler_name = "ode"
    sampler_params = {"steps": 6}


class TestODEDPMSolver2M(SamplerConformance):
    sampler_name = "ode"
    sampler_params = {"steps": 7, "kernel": "dpmpp2m", "schedule": {"type": "shift", "shift": 3.0}}


class TestODEDPMSolver3MSharedNoise(SamplerConformance):
    sampler_name = "ode"
    sampler_params = {"steps": 5, "kernel": "dpmpp3m", "share_noise": True}
