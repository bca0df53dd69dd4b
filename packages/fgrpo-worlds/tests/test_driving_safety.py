"""The safety filter (fgrpo.worlds.driving.safety): hand-computed braking and predictions, which
candidates it keeps and why, what it executes, its counts, its keys, and the evaluators with it."""

from __future__ import annotations

import pytest
import torch

from fgrpo.worlds.driving import closed_loop, safety, scenes
from fgrpo.worlds.driving.testing import constant_speed, custom


def scene_of(prompt: str):
    return scenes.scenes_for([prompt])


def test_the_braking_plan_by_hand():
    # 10 m/s at 5 m/s^2 stops after 2 s and 10 m: x = 10 t - 2.5 t^2 until then
    s = scene_of(custom("brake", ego=(1, 10.0)))
    plan = safety.braking_plan(s, 5.0)[0]
    expected = [4.375, 7.5, 9.375, 10.0, 10.0, 10.0, 10.0, 10.0]
    assert plan[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert plan[:, 1].abs().max().item() == 0.0


def test_constant_velocity_prediction_by_hand():
    s = scene_of(custom("cv", agents=[(1, 40.0, 12.0)]))
    paths = safety.constant_velocity_paths(s, 20)  # 2 s
    x0 = s.agents[0, 0, 0].item()
    assert paths.shape[:3] == (1, 21, s.agents.shape[1])
    assert paths[0, 20, 0, 0].item() == pytest.approx(x0 + 24.0, abs=1e-4)
    assert paths[0, 20, 0, 1].item() == pytest.approx(s.agents[0, 0, 1].item(), abs=1e-6)


def test_a_plan_into_a_stopped_car_is_replaced_by_the_first_kept_candidate_and_counted():
    # a stopped car 50 m ahead: holding 20 m/s meets it at 2.3 s (inside the 3 s horizon);
    # braking to a stop at 5 m/s^2 covers 40 m and keeps clear
    prompt = custom("wall-ahead", agents=[(1, 50.0, 0.0)])
    s = scene_of(prompt)
    stop = safety.braking_plan(s, 5.0)
    plans = torch.stack([constant_speed(20.0), stop, constant_speed(20.0)], 1)  # (1, 3, T, 2)
    f = safety.SafetyFilter(candidates=3, base=False, horizon=3.0)
    check = f.check(s, plans)
    assert check.kept.tolist() == [[False, True, False]]
    assert check.collision.tolist() == [[True, False, True]] and not check.off_road.any()
    tally = safety.Interventions()
    chosen = f.choose(s, plans, tally)
    assert torch.equal(chosen, stop)
    assert tally.metrics() == {
        "filter/intervened": 1.0,
        "filter/braked": 0.0,
        "filter/predicted_collision": 1.0,
        "filter/predicted_off_road": 0.0,
        "filter/predicted_close": 0.0,
    }


def test_a_kept_plan_passes_unchanged_and_nothing_kept_brakes():
    free = scene_of(custom("open-road"))
    own = constant_speed(20.0)
    plans = torch.stack([own, constant_speed(25.0)], 1)
    tally = safety.Interventions()
    f = safety.SafetyFilter(candidates=2, base=False)
    assert torch.equal(f.choose(free, plans, tally), own)  # the least intervention: the planner's own
    assert tally.replaced == 0 and tally.replannings == 1
    # best: the kept candidate with the higher progress x TTC factor (the faster plan on a free road)
    assert torch.equal(safety.SafetyFilter(candidates=2, base=False, select="best").choose(free, plans), plans[:, 1])
    # a departure: 8 m to the left leaves a 3-lane road from its left lane
    left = custom("left-edge", ego=(2, 20.0))
    off = torch.stack([constant_speed(20.0, y=8.0)], 1)
    check = f.check(scene_of(left), off)
    assert check.off_road.tolist() == [[True]] and check.kept.tolist() == [[False]]
    wall = scene_of(custom("wall-near", agents=[(1, 25.0, 0.0)]))  # 20.5 m of bumper gap at 20 m/s
    tally = safety.Interventions()
    out = f.choose(wall, torch.stack([constant_speed(20.0)], 1), tally)
    assert torch.equal(out, safety.braking_plan(wall, f.brake)) and tally.braked == 1


def test_min_ttc_rejects_a_close_plan_that_does_not_collide():
    # a car 30 m ahead at 15 m/s, the ego at 20: it closes at 5 m/s from a 25.5 m gap (TTC 5.1 s) and
    # holds 20 m/s for the 3 s horizon without touching it (gap 10.5 m at the end: TTC 2.1 s)
    s = scene_of(custom("slow-ahead", agents=[(1, 30.0, 15.0)]))
    plans = torch.stack([constant_speed(20.0)], 1)
    assert safety.SafetyFilter(base=False, candidates=1).check(s, plans).kept.item()
    check = safety.SafetyFilter(base=False, candidates=1, min_ttc=3.0).check(s, plans)
    assert check.close.item() and not check.collision.item() and not check.kept.item()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3, "got 3; allowed: null (off) or a mapping with keys candidates, base, horizon"),
        ({"candidate": 4}, "got unknown key(s) 'candidate'; allowed keys: candidates, base"),
        ({"candidates": 0}, "candidates: got 0; allowed: >= 1 and <= 64"),
        ({"select": "safest"}, "select: got 'safest'; allowed: 'first', 'best'"),
        ({"horizon": "long"}, "got horizon 'long'; allowed: a number"),
        ({"base": 1}, "got base 1; allowed: true or false"),
    ],
)
def test_bad_filter_keys_are_one_line(value, message):
    with pytest.raises(ValueError, match=None) as raised:
        safety.build(value)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def _context(generate, policy, prompts=()):
    from fgrpo.core.protocols import EvalContext

    return EvalContext(
        policy=policy,
        prompts=list(prompts),
        metadata=lambda p: {},
        generate=generate,
        samples=None,
        sample_prompts=[],
        seed=0,
        iteration=0,
    )


class _Reference:
    """A stand-in policy: ``reference()`` switches what the generator draws to the base's plans."""

    def __init__(self):
        self.base = False

    def reference(self):
        import contextlib

        @contextlib.contextmanager
        def swap():
            self.base = True
            try:
                yield
            finally:
                self.base = False

        return swap()


def test_the_evaluation_planner_asks_the_policy_its_own_plan_more_draws_and_the_bases():
    policy = _Reference()
    calls = []

    def generate(names, per_prompt, g):
        calls.append((names[0].split()[-1].rsplit("-", 1)[0], per_prompt, policy.base))
        speed = 10.0 if policy.base else 20.0 + len(calls)
        return constant_speed(speed, n=len(names) * per_prompt)

    prompt = custom("open-road-2")
    planner, tally = closed_loop.evaluation_planner(_context(generate, policy), "cl", {"candidates": 3})
    plan = planner(scene_of(prompt), 0)
    assert calls == [("cl", 1, False), ("cl-more", 2, False), ("cl-base", 1, True)]
    assert torch.equal(plan, constant_speed(21.0))  # the policy's own plan, kept: unchanged
    assert tally is not None and tally.replannings == 1
    alone, none = closed_loop.evaluation_planner(_context(generate, policy), "cl", None)
    own = alone(scene_of(prompt), 0)  # the fourth draw: one plan of the policy, nothing else
    assert none is None and calls[3:] == [("cl", 1, False)] and torch.equal(own, constant_speed(24.0))


def test_the_closed_loop_with_the_filter_keeps_clear_of_a_stopped_car():
    # the planner holds 20 m/s into a stopped car 60 m ahead; the filter brakes in time
    prompt = custom("wall-far", agents=[(1, 60.0, 0.0)])
    start = scene_of(prompt)

    def candidates(scene, _round):
        return torch.stack([constant_speed(float(scene.ego[0, 3]))], 1)

    alone = closed_loop.drive(lambda s, r: candidates(s, r)[:, 0], start, 6.0)
    tally = safety.Interventions()
    filtered = closed_loop.drive(
        safety.filtered_planner(candidates, safety.SafetyFilter(candidates=1, base=False), tally), start, 6.0
    )
    assert alone.collision.item() and not filtered.collision.item()
    assert tally.braked >= 1 and tally.replannings == 12


# --- shadow mode ---------------------------------------------------------------------------------


def test_shadow_metrics_by_hand():
    """A plan that is the driver's path has ADE = FDE = 0; one 1 m to its left everywhere 1 m; the
    plan that holds 20 m/s into a stopped car 50 m ahead would collide, the driver who stops not."""
    from fgrpo.worlds.driving import shadow

    s = scene_of(custom("shadow-wall", agents=[(1, 50.0, 0.0)]))
    stop = safety.braking_plan(s, 5.0)
    same = shadow.shadow_metrics(stop.clone(), stop, s)
    assert same["ade"].item() == 0.0 and same["fde"].item() == 0.0 and same["collision"].item() == 0.0
    left = stop + torch.tensor([0.0, 1.0])
    assert shadow.shadow_metrics(left, stop, s)["ade"].item() == pytest.approx(1.0, abs=1e-6)
    fast = shadow.shadow_metrics(constant_speed(20.0), stop, s)
    assert fast["collision"].item() == 1.0 and fast["ttc_under_2s"].item() == 1.0
    assert fast["driver_collision"].item() == 0.0
    assert fast["fde"].item() == pytest.approx(80.0 - stop[0, -1, 0].item(), abs=1e-4)


def test_shadow_mode_of_the_teacher_beside_its_own_logs_disagrees_by_nothing():
    """The teacher as the planner (its own plan from each scene the evaluator registers) beside
    the teacher's logs: ADE 0 to rounding, its would-be figures the driver's, per scenario type."""
    from fgrpo.worlds.driving import shadow

    prompts = [scenes.prompt_of(kind, 1_000_000 + i) for i, kind in enumerate(["stopped", "cut-in"])]

    def generate(names, per_prompt, _g):
        return scenes.teacher_plans(list(names))

    evaluator = shadow.ShadowEvaluator(times=[0.0, 2.5])
    metrics = evaluator(_context(generate, _Reference(), prompts)).metrics
    assert metrics["ade"] == pytest.approx(0.0, abs=1e-4) and metrics["fde"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["collision"] == metrics["driver_collision"]
    assert metrics["ttc_under_2s"] == metrics["driver_ttc_under_2s"]
    assert {"ade/stopped", "ade/cut-in"} <= set(metrics)


def test_shadow_mode_in_highway_env_records_its_idm_drivers_path():
    """highway-env's IDM ego drives; every 0.5 s a scene and the 4 s the driver went on, in that
    scene's ego frame (forward, at about its speed)."""
    pytest.importorskip("highway_env")
    from fgrpo.worlds.driving import shadow

    start, driven = shadow.highway_drives(episodes=1, seed=3, seconds=5.0, lanes=3, vehicles=5)
    assert len(start) == 2 and start.t.tolist() == [0.0, 0.5] and driven.shape == (2, 8, 2)
    speed = start.ego[0, 3].item()
    assert driven[0, 0, 0].item() == pytest.approx(0.5 * speed, rel=0.2)  # half a second at about its speed
    assert torch.all(driven[:, 1:, 0] > driven[:, :-1, 0])
