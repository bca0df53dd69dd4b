"""The randomised driving world (``prompts.randomize``): every draw inside its range and a pure
function of (type, seed), keys left out untouched, added cars apart, the training scenarios and
their logs randomised while held-out scenarios keep the defaults, and bad ranges refused in one line."""

from __future__ import annotations

import pytest
import torch

from fgrpo.core import cli
from fgrpo.worlds.driving import randomize, scenes, sim
from fgrpo.worlds.driving.prompts import TEST_SEED_BASE, DrivingPrompts
from fgrpo.worlds.driving.world import TYPES, Scene, generate, lane_centre

SPEC = {
    "desired_speed": [0.8, 1.2],
    "headway": [0.8, 2.0],
    "min_gap": [1.0, 5.0],
    "max_accel": [1.0, 3.0],
    "comfort_decel": [2.0, 6.0],
    "lane_change_rate": [0.2, 0.6],
    "lane_change_duration": [2.5, 3.5],
    "cars_per_lane": [1.0, 3.0],
}
KINDS = [k for k in range(len(TYPES)) for _ in range(12)]
SEEDS = list(range(len(KINDS)))


@pytest.fixture(autouse=True)
def _fresh_scenes():
    scenes.forget()
    yield
    scenes.forget()


def test_every_draw_lies_in_its_range_and_depends_on_type_and_seed_only():
    base = generate(KINDS, SEEDS)
    out = randomize.randomize(base, SPEC)
    moving = out.valid & (out.idm[..., 0] > 0)
    factor = out.idm[..., 0][moving] / out.agents[..., 3][moving]
    assert factor.min() >= 0.8 - 1e-6 and factor.max() <= 1.2 + 1e-6
    for column, key in enumerate(("headway", "min_gap", "max_accel", "comfort_decel"), start=1):
        values = out.idm[..., column][out.valid]
        low, high = SPEC[key]
        assert values.min() >= low and values.max() <= high, key
        assert values.max() - values.min() > 0.5 * (high - low), key  # drawn, not one value
    # the same scenario alone, or in another batch, is the same randomised scene
    alone = randomize.randomize(generate([KINDS[7]], [SEEDS[7]]), SPEC)
    for field in Scene.FIELDS:
        assert torch.equal(getattr(alone, field).nan_to_num(), getattr(out, field)[7:8].nan_to_num()), field
    # the stopped car stays stopped
    stopped = torch.tensor(KINDS) == TYPES.index("stopped")
    assert (out.idm[stopped, 0, 0] == 0).all()


def test_a_fraction_randomises_that_share_of_scenarios_and_leaves_the_others_as_generated():
    base = generate(KINDS, SEEDS)
    whole = randomize.randomize(base, SPEC)
    half = randomize.randomize(base, {**SPEC, "fraction": 0.5})
    fields = ("agents", "valid", "idm", "lane_change")

    def same(a, b, i):
        return all(torch.equal(getattr(a, f)[i].nan_to_num(), getattr(b, f)[i].nan_to_num()) for f in fields)

    drawn = [i for i in range(len(KINDS)) if same(half, whole, i)]
    kept = [i for i in range(len(KINDS)) if same(half, base, i)]
    assert sorted(drawn + kept) == list(range(len(KINDS)))  # each scenario one or the other, whole
    assert 0.3 * len(KINDS) < len(drawn) < 0.7 * len(KINDS)
    # which ones does not depend on the batch, and a fraction of 1 is no fraction
    alone = randomize.randomize(generate([KINDS[kept[0]]], [SEEDS[kept[0]]]), {**SPEC, "fraction": 0.5})
    assert torch.equal(alone.idm, base.idm[kept[0] : kept[0] + 1])
    everything = randomize.randomize(base, {**SPEC, "fraction": 1.0})
    assert all(same(everything, whole, i) for i in range(len(KINDS)))


def test_keys_left_out_keep_the_scenes_own_values():
    base = generate(KINDS, SEEDS)
    out = randomize.randomize(base, {"headway": [1.0, 1.1]})
    for field in Scene.FIELDS:
        if field != "idm":
            assert torch.equal(getattr(out, field).nan_to_num(), getattr(base, field).nan_to_num()), field
    assert torch.equal(out.idm[..., [0, 2, 3, 4]], base.idm[..., [0, 2, 3, 4]])


def test_added_cars_keep_their_distance_and_lane_changes_go_to_a_neighbour():
    base = generate(KINDS, SEEDS)
    out = randomize.randomize(base, SPEC)
    added = out.valid & ~base.valid
    assert added.any() and (out.valid.sum(1) >= base.valid.sum(1)).all()
    for b in range(len(out)):
        rows = out.valid[b].nonzero().flatten()
        for i in rows:
            if not added[b, i]:
                continue
            same_lane = [j for j in rows if j != i and abs(out.agents[b, j, 1] - out.agents[b, i, 1]) < 1.0]
            assert all(abs(out.agents[b, j, 0] - out.agents[b, i, 0]) >= randomize.SPACING for j in same_lane)
            assert abs(out.agents[b, i, 1] - out.ego[b, 1]) > 1.0 or abs(out.agents[b, i, 0]) >= randomize.SPACING
    changed = out.valid & (out.lane_change[..., 3] > 0) & (base.lane_change[..., 3] == 0)
    share = changed.sum() / (out.valid & (base.lane_change[..., 3] == 0)).sum()
    assert 0.2 < share < 0.6
    lanes_apart = (out.lane_change[..., 1] - out.lane_change[..., 0])[changed].abs()
    assert torch.allclose(lanes_apart, torch.tensor(3.5))
    assert ((out.lane_change[..., 3][changed] >= 2.5) & (out.lane_change[..., 3][changed] <= 3.5)).all()
    top = lane_centre(out.lanes - 1, out.lane_width)[:, None].expand_as(changed)
    assert (out.lane_change[..., 1][changed] <= top[changed]).all() and (out.lane_change[..., 1] > 0).all()


def test_training_scenarios_and_their_logs_are_randomised_and_held_out_ones_are_not():
    source = DrivingPrompts(
        types=["dense", "cut-in"],
        train_seeds=3,
        test_seeds=2,
        times=[0.0, 1.0],
        closed_loop={"scenarios": 2, "every": 5, "times": [1.5]},
        randomize=SPEC,
    )
    expected = randomize.randomize(generate([4, 4, 4, 3, 3, 3], [0, 1, 2, 0, 1, 2]), SPEC)
    got = scenes.scenes_for([f"{t} {s} t0" for t in ("dense", "cut-in") for s in range(3)])
    assert torch.equal(got.idm, expected.idm) and torch.equal(got.valid, expected.valid)
    # a later training time is the teacher driven on from the randomised scene, and its plan the log's future
    later = expected.index(slice(0, 1))
    for _ in range(10):
        later = sim.advance(later, *sim.teacher_control(later), reactive=True)
    one = scenes.scenes_for(["dense 0 t1"])
    assert torch.allclose(one.ego, later.ego) and torch.allclose(one.agents, later.agents)
    plan = scenes.teacher_plans(["dense 0 t1"])
    assert torch.allclose(plan, sim.teacher_plan(one), atol=1e-4)
    # the closed loop's starting states before its first refresh: the randomised teacher's too
    self_prompt = [p for p in source.train_prompts() if p.endswith("self")][0]
    kind, seed = self_prompt.split()[:2]
    logged = scenes.scenes_for([f"{kind} {seed} t1.5"])
    assert torch.equal(scenes.scenes_for([self_prompt]).ego, logged.ego)
    # held-out scenarios: the generator's own
    test = scenes.scenes_for(source.test_prompts())
    default = generate([4, 4, 3, 3], [TEST_SEED_BASE, TEST_SEED_BASE + 1] * 2)
    assert torch.equal(test.idm, default.idm) and torch.equal(test.valid, default.valid)


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        ("{headway: [2.0, 1.0]}", "headway: got [2.0, 1.0]; allowed: [low, high] with 0.1 <= low <= high <= 4"),
        ("{politeness: [0, 1]}", "politeness: unknown key"),
        ("{lane_change_rate: [0.1, 1.5]}", "lane_change_rate: got [0.1, 1.5]"),
        ("[1, 2]", "expected a mapping or null, got [1, 2]"),
        ("{headway: [1, 2], fraction: 1.5}", "fraction: got 1.5; allowed: a number from 0 to 1"),
    ],
)
def test_a_bad_range_is_one_line_naming_the_key(value, allowed, capsys):
    code = cli.main(["validate", "driving", "--set", f"prompts.randomize={value}"])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err and captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: prompts.randomize: ") and allowed in lines[0], lines


def test_highway_starts_without_highway_env_are_one_line_naming_the_extra(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "highway_env", None)  # import highway_env raises ImportError
    code = cli.main(["validate", "driving", "--set", "prompts.highway={episodes: 2}"])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err
    first = captured.err.splitlines()[0]
    assert first.startswith("error: prompts.highway: ") and 'pip install "fgrpo-worlds[highway]"' in first, first
