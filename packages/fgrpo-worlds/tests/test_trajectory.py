"""The ``trajectory`` planner: the Policy conformance suite (full fine-tuning and LoRA), the shipped
BC base, normalisation round trips, weights files, export."""

from __future__ import annotations

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.testing import PolicyConformance
from fgrpo.worlds.driving.planner import (
    Architecture,
    TrajectoryPolicy,
    default_weights_path,
    from_waypoints,
    load_network,
    to_waypoints,
)


class TestTrajectoryFull(PolicyConformance):
    model_name = "trajectory"
    model_params = {"path": "random", "hidden": 32, "blocks": 1}
    prompts = ("cut-in 3 t1", "free 7")
    reward = {"name": "driving-pdms"}
    outputs_in_unit_range = False


class TestTrajectoryLoRA(PolicyConformance):
    model_name = "trajectory"
    model_params = {"lora": {"rank": 2}}  # the shipped base
    prompts = ("stopped 2 t3", "dense 9")
    reward = {"name": "driving-carl"}
    outputs_in_unit_range = False


def test_the_shipped_base_is_small_and_knows_what_a_plan_looks_like():
    net = load_network(default_weights_path())
    assert sum(p.numel() for p in net.parameters()) < 200_000
    policy = registry.create("model", "trajectory")
    from fgrpo.core.evaluation import generate

    plans = generate(policy, ["free 1000001", "stopped 1000002"], 4, 10, torch.Generator().manual_seed(0))
    assert plans.shape == (8, 8, 2) and torch.isfinite(plans).all()
    assert (plans[:, 1:, 0] > plans[:, :-1, 0] - 0.5).all()  # forward, roughly monotone
    assert plans[:, :, 1].abs().max() < 8.0  # within a couple of lanes


def test_normalisation_round_trip_and_3d_plans():
    for dims in (2, 3):
        arch = Architecture(dims=dims)
        w = torch.randn(5, 8, dims) * torch.tensor([10.0, 2.0, 0.1][:dims]) + torch.tensor([30.0, 0, 0][:dims])
        torch.testing.assert_close(to_waypoints(from_waypoints(w, arch), arch), w, rtol=1e-5, atol=1e-4)
    policy = registry.create("model", "trajectory", path="random", dims=3, hidden=16, blocks=1)
    assert policy.initial_noise(2).shape == (2, 8, 3) and policy.decode(policy.initial_noise(2)).shape == (2, 8, 3)


def test_bad_prompts_and_weights_are_one_line(tmp_path):
    policy = registry.create("model", "trajectory", path="random", hidden=16, blocks=1)
    assert policy.check_prompts(["free 1", "a red circle"]) == [
        "'a red circle' is not a driving scene; expected '<type> <seed> [t<seconds>] [tag]' with a type of free, "
        "slow-lead, "
        "stopped, cut-in, dense, e.g. 'cut-in 42 t2.5'"
    ]
    bad = tmp_path / "x.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(bad))
    with pytest.raises(Exception, match="is not a trajectory weights file"):
        registry.create("model", "trajectory", path=str(bad))
    with pytest.raises(Exception, match="model.horizon: got 6 but the weights have 8"):
        registry.create("model", "trajectory", horizon=6)


def test_export_merges_the_adapter(tmp_path):
    policy = registry.create("model", "trajectory", lora={"rank": 2, "init": "random"})
    x = policy.initial_noise(3, torch.Generator().manual_seed(1))
    cond = policy.encode(["free 1", "cut-in 2", "dense 3"])
    sigma = torch.full((3,), 0.5)
    with torch.no_grad():
        v = policy.velocity(x, sigma, cond)
        (path,) = policy.export(str(tmp_path))
        exported = registry.create("model", "trajectory", path=path)
        torch.testing.assert_close(exported.velocity(x, sigma, cond), v, rtol=1e-4, atol=1e-5)
    assert isinstance(exported, TrajectoryPolicy)
