"""The driving world against hand-computed cases: the scenario generator is a pure function of
(type, seed), IDM, the bicycle and the tracking controller, a collision at a known time, a known
jerk, the TTC of two cars closing at known speeds, and every reward term."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.core import registry
from fgrpo.core.config import check_params
from fgrpo.worlds.driving import closed_loop, features, prompts, rewards, scenes, sim
from fgrpo.worlds.driving.testing import constant_speed, custom
from fgrpo.worlds.driving.world import CAR_LENGTH, HORIZON_STEPS, LANE_WIDTH, TYPES, Scene, generate, uniforms

T = torch.arange(1, HORIZON_STEPS + 1, dtype=torch.float32) * 0.5


def score(name: str, plans: torch.Tensor, prompt_list, **keys):
    reward = registry.create("reward", name, **keys)
    return reward(plans, prompt_list, [{}] * len(prompt_list))


# --- the scenario generator -----------------------------------------------------------------------


def test_a_scenario_is_a_pure_function_of_type_and_seed():
    alone = generate([3], [42])
    mixed = generate([0, 3, 1, 3], [5, 42, 9, 43])
    for field in Scene.FIELDS:
        a, b = getattr(alone, field), getattr(mixed, field)[1:2]
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), field
    assert not torch.equal(mixed.ego[1], mixed.ego[3])  # another seed, another scene
    u = uniforms(torch.tensor([1, 1]), torch.tensor([7, 8]), 4)
    assert u.shape == (2, 4) and ((u >= 0) & (u < 1)).all() and not torch.equal(u[0], u[1])
    again = uniforms(torch.tensor([1]), torch.tensor([7]), 4)
    assert torch.equal(u[:1], again)


def test_scenario_types_set_up_what_they_name():
    s = generate(list(range(len(TYPES))), [3] * len(TYPES))
    ego_y = s.ego[:, 1]
    lead = s.agents[:, 0]
    assert (
        s.valid[1, 0] and (lead[1, 1] - ego_y[1]).abs() < 1e-5 and lead[1, 3] < s.ego[1, 3]
    )  # slow lead in the ego's lane
    assert s.valid[2, 0] and lead[2, 3] == 0 and s.idm[2, 0, 0] == 0  # stopped car, stays stopped
    cut = s.lane_change[3, 0]
    assert (cut[1] - ego_y[3]).abs() < 1e-5 and cut[3] > 0  # the cut-in car heads into the ego's lane
    assert s.valid[4].sum() >= 6  # dense traffic
    assert set(s.lanes.tolist()) <= {2.0, 3.0, 4.0}


# --- kinematics -----------------------------------------------------------------------------------


def test_idm_by_hand():
    # v 20, v0 30, bumper gap 30 m, closing at 5 m/s, T 1.5 s, s0 2 m, a 1.5, b 2
    params = torch.tensor([[30.0, 1.5, 2.0, 1.5, 2.0]])
    s_star = 2 + 20 * 1.5 + 20 * 5 / (2 * math.sqrt(1.5 * 2))
    expected = 1.5 * (1 - (20 / 30) ** 4 - (s_star / 30) ** 2)
    a = sim.idm_acceleration(torch.tensor([20.0]), torch.tensor([30.0]), torch.tensor([5.0]), params)
    assert a.item() == pytest.approx(expected, rel=1e-5)
    free = sim.idm_acceleration(torch.tensor([20.0]), torch.tensor([math.inf]), torch.tensor([0.0]), params)
    assert free.item() == pytest.approx(1.5 * (1 - (20 / 30) ** 4), rel=1e-6)


def test_the_bicycle_and_a_known_jerk():
    ego = torch.tensor([[0.0, 0.0, 0.0, 10.0, 0.0]])
    # the acceleration ramps up at 2 m/s^3: 0.2, 0.4, ... m/s^2 every 0.1 s
    states = [ego]
    for k in range(1, 11):
        states.append(sim.bicycle(states[-1], torch.tensor([0.2 * k]), torch.tensor([0.0])))
    accel = torch.stack([s[0, 4] for s in states])
    jerk = (accel[1:] - accel[:-1]) / sim.DT
    torch.testing.assert_close(jerk, torch.full((10,), 2.0), rtol=0, atol=1e-4)
    v = 10 + sum(0.2 * k * 0.1 for k in range(1, 11))
    assert states[-1][0, 3].item() == pytest.approx(v, abs=1e-5)
    # steering: a constant angle drives a circle of radius L / tan(delta)
    turn = ego.clone()
    for _ in range(10):
        turn = sim.bicycle(turn, torch.tensor([0.0]), torch.tensor([0.1]))
    assert turn[0, 2].item() == pytest.approx(10.0 * math.tan(0.1) / 2.7 * 1.0, rel=1e-5)


def test_the_tracker_follows_a_constant_speed_plan_exactly():
    prompt = custom("cv")
    scene = scenes.scenes_for([prompt])
    out = sim.simulate_plan(scene, constant_speed(20.0), 4.0)
    ego = out["ego"][0]
    torch.testing.assert_close(ego[:, 0], torch.arange(41, dtype=torch.float32) * 0.1 * 20.0, rtol=0, atol=1e-3)
    assert ego[:, 1].sub(scene.ego[0, 1]).abs().max() < 1e-4 and ego[:, 4].abs().max() < 1e-3


def test_a_collision_at_a_known_time():
    # a stopped car 50 m ahead (centre to centre) in the ego's lane; the ego holds 20 m/s: the
    # bumpers meet when the ego has covered 50 - 4.5 = 45.5 m, at 2.275 s: the 0.1 s step at 2.3 s
    prompt = custom("wall", agents=[(1, 50.0, 0.0)])
    result = score("driving-safety", constant_speed(20.0), [prompt])
    assert result.scores.item() == 0.0 and result.details["collision"].item() == 1.0
    o = rewards.outcome(constant_speed(20.0), [prompt], 4.0)
    assert o.collision_time.item() == pytest.approx(2.3, abs=1e-6)
    assert "collision at 2.3 s" in result.details["read"][0]
    stop_short = torch.stack([torch.tensor([4.75, 8.0, 9.75, 10.0, 10.0, 10.0, 10.0, 10.0]), torch.zeros(8)], -1)[None]
    assert rewards.outcome(stop_short, [prompt], 4.0).collision.item() is False


def test_the_reactive_simulation_is_the_closed_loops_execution_of_one_plan():
    # a faster car 30 m behind the ego in its lane: without the ego in its world it drives through
    # it (a collision from behind, not the ego's fault, not counted); among reactive traffic it
    # brakes to the ego's speed behind it, as the closed loop's cars do, and no collision is there
    prompt = custom("tailgater", ego=(1, 10.0), agents=[(1, -30.0, 20.0)])
    scene = scenes.scenes_for([prompt])
    # (blind, the bumpers meet at 25.5 m / 10 m/s = 2.55 s; at 2.7 s the boxes overlap by 1.5 m)
    blind = sim.simulate_plan(scene, constant_speed(10.0), 2.7)
    seen = sim.simulate_plan(scene, constant_speed(10.0), 8.0, reactive=True)
    overlap = CAR_LENGTH - (blind["ego"][0, -1, 0] - blind["agents"][0, -1, 0, 0])
    assert not blind["collision"].any() and overlap.item() == pytest.approx(1.5, abs=1e-3)
    gap = seen["ego"][0, :, 0] - seen["agents"][0, :, 0, 0] - CAR_LENGTH
    assert not seen["collision"].any() and gap.min() > 1.0
    assert seen["agents"][0, -1, 0, 3].item() == pytest.approx(10.0, abs=0.5)
    # every state of it is what sim.execute (the closed loop's step) gives for the same plan
    dense = generate([4, 3], [7, 8])
    plan = constant_speed(18.0, y=0.5, n=2)
    run = sim.simulate_plan(dense, plan, 4.0, reactive=True)
    _, after = sim.execute(dense, plan, 4.0)
    assert torch.equal(run["ego"][:, 1:], torch.stack([s.ego for s in after], 1))
    assert torch.equal(run["agents"][:, 1:], torch.stack([s.agents for s in after], 1))
    # and a term measures it when asked: the same plan scores apart where the traffic reacts
    assert rewards.outcome(constant_speed(10.0), [prompt], 8.0, reactive=True).collision.item() is False
    assert score("driving-carl", constant_speed(10.0), [prompt], reactive=True, horizon=8.0).scores.shape == (1,)


def test_time_to_collision_of_two_cars_closing_at_known_speeds():
    # ego 20 m/s, the car ahead 10 m/s, 20 m between the bumpers: 2 s
    ego = torch.tensor([[0.0, 5.25, 0.0, 20.0, 0.0]])
    car = torch.tensor([[[20.0 + CAR_LENGTH, 5.25, 0.0, 10.0]]])
    assert sim.time_to_collision(ego, car, torch.tensor([[True]])).item() == pytest.approx(2.0, rel=1e-6)
    beside = car.clone()
    beside[..., 1] += LANE_WIDTH
    assert math.isinf(sim.time_to_collision(ego, beside, torch.tensor([[True]])).item())  # another lane
    faster = car.clone()
    faster[..., 3] = 25.0
    assert math.isinf(sim.time_to_collision(ego, faster, torch.tensor([[True]])).item())  # not closing
    # the reward: 1 s of TTC left against a threshold of 1.5 s is 2/3 (car 10 m ahead at 20 vs 10 m/s)
    prompt = custom("closing", agents=[(1, 10.0 + CAR_LENGTH + 20.0 * 0.1 - 10.0 * 0.1, 10.0)])
    o = rewards.outcome(constant_speed(20.0), [prompt], 0.1)
    assert o.min_ttc.item() == pytest.approx(1.0, abs=1e-3)


def test_boxes_overlap_by_hand():
    a = torch.tensor([0.0, 0.0, 0.0])
    assert sim.boxes_overlap(a, torch.tensor([4.4, 0.0, 0.0])) and not sim.boxes_overlap(
        a, torch.tensor([4.6, 0.0, 0.0])
    )
    assert sim.boxes_overlap(a, torch.tensor([0.0, 1.7, 0.0])) and not sim.boxes_overlap(
        a, torch.tensor([0.0, 1.9, 0.0])
    )
    # rotated 90 degrees: its half-length now lies across; 0.9 + 2.25 = 3.15 along x
    assert sim.boxes_overlap(a, torch.tensor([3.1, 0.0, math.pi / 2])) and not sim.boxes_overlap(
        a, torch.tensor([3.2, 0.0, math.pi / 2])
    )


# --- the reward terms -------------------------------------------------------------------------------


def test_progress_comfort_rules_drivable_pdms_and_carl_by_hand():
    prompt = custom("free-road", limit=25.0)  # ego 20 m/s in the middle of 3 lanes, nobody around
    cv = constant_speed(20.0)
    # free-road distance: 1.5 m/s^2 from 20 to 25 m/s takes 3.33 s, then 25 m/s
    reach = 5 / 1.5
    free = 20 * reach + 0.75 * reach**2 + 25 * (4 - reach)
    assert score("driving-progress", cv, [prompt]).scores.item() == pytest.approx(80 / free, rel=1e-4)
    assert score("driving-safety", cv, [prompt]).scores.item() == 1.0  # nobody: TTC inf
    assert score("driving-comfort", cv, [prompt]).scores.item() == pytest.approx(1.0, abs=1e-4)
    assert score("driving-rules", cv, [prompt]).scores.item() == pytest.approx(1.0, abs=1e-6)
    assert score("driving-drivable", cv, [prompt]).scores.item() == 1.0
    pdms = score("driving-pdms", cv, [prompt]).scores.item()
    assert pdms == pytest.approx((5 + 5 * 80 / free + 2) / 12, rel=1e-4)
    assert score("driving-carl", cv, [prompt]).scores.item() == pytest.approx(80 / free, rel=1e-3)
    # 4 m/s over a 16 m/s limit for the whole horizon: exp(-4 / 2)
    fast = custom("speeding", limit=16.0)
    assert score("driving-rules", cv, [fast]).scores.item() == pytest.approx(math.exp(-2.0), rel=1e-3)
    # off the road: steering 6 m to the right from the rightmost lane's centre
    edge = custom("edge", ego=(0, 20.0))
    out = torch.stack([20.0 * T, -torch.linspace(0.75, 6.0, 8)], -1)[None]
    assert score("driving-drivable", out, [edge]).scores.item() == 0.0
    assert score("driving-pdms", out, [edge]).scores.item() == 0.0


def test_imitation_and_consistency_by_hand():
    prompt = "slow-lead 3 t2"
    teacher = scenes.teacher_plans([prompt])
    assert score("driving-imitation", teacher, [prompt]).scores.item() == pytest.approx(1.0, abs=1e-6)
    shifted = teacher + torch.tensor([0.0, 2.0])
    assert score("driving-imitation", shifted, [prompt]).scores.item() == pytest.approx(math.exp(-1.0), rel=1e-5)
    # the log scene at 2 s has the teacher's plan from 1.5 s as its previous plan: the teacher's
    # own plan now is consistent with it up to the teacher's steering
    assert score("driving-consistency", teacher, [prompt]).scores.item() > 0.9
    assert score("driving-consistency", shifted, [prompt]).scores.item() < 0.2
    assert score("driving-consistency", teacher, ["slow-lead 3"]).scores.item() == 1.0  # t0: no previous plan


def test_a_log_scene_is_the_teacher_driven_from_t0_and_its_plan_the_log_future():
    log = scenes.scenes_for(["cut-in 5 t1.5"])
    start = scenes.scenes_for(["cut-in 5"])
    later = sim.teacher_rollout(start, 15)[-1]
    torch.testing.assert_close(log.ego, later.ego, rtol=0, atol=1e-5)
    plan = scenes.teacher_plans(["cut-in 5 t1.5"])
    torch.testing.assert_close(plan, sim.teacher_plan(log), rtol=0, atol=1e-4)


def test_every_term_is_deterministic_and_per_type():
    batch = [scenes.prompt_of(t, s, 1.0) for t in TYPES for s in range(2)]
    plans = scenes.teacher_plans(batch) + 0.3 * torch.randn(
        len(batch), HORIZON_STEPS, 2, generator=torch.Generator().manual_seed(0)
    )
    for name in ("driving-safety", "driving-pdms", "driving-carl", "driving-comfort"):
        a, b = score(name, plans, batch), score(name, plans.clone(), batch)
        assert torch.equal(a.scores, b.scores) and a.scores.shape == (len(batch),)
        assert a.details["category"] == [p.split()[0] for p in batch]
        assert ((a.scores >= 0) & (a.scores <= 1)).all()


def test_features_are_38_finite_numbers_per_scene():
    enc = prompts.DrivingPrompts.encode_prompts(["dense 1 t3", "stopped 2"])
    assert enc.shape == (2, features.SIZE) and torch.isfinite(enc).all()


def test_the_closed_loop_of_the_teacher_and_of_constant_velocity():
    batch = [scenes.prompt_of("stopped", s) for s in range(2)]
    start = scenes.scenes_for(batch)
    cv = closed_loop.drive(closed_loop.constant_velocity_planner, start, 6.0)
    teacher = closed_loop.drive(closed_loop.teacher_planner, start, 6.0)
    # constant velocity runs into the stopped car (60-110 m ahead) when it gets there within 6 s
    reach = start.ego[:, 3] * 6.0 > start.agents[:, 0, 0] - CAR_LENGTH
    assert cv.collision[reach].all()
    assert teacher.collision.float().mean() <= cv.collision.float().mean()
    m = closed_loop.summarize(teacher, start.kind)
    assert set(closed_loop.METRICS) <= set(m) and "cl_score/stopped" in m


def test_the_closed_loop_measures_speeding_above_the_limit():
    fast, legal = custom("fast-35", lanes=2, limit=30.0, ego=(0, 35.0)), custom("legal-25", lanes=2, ego=(0, 25.0))
    start = scenes.scenes_for([fast, legal])
    loop = closed_loop.drive(closed_loop.constant_velocity_planner, start, 4.0)
    # constant velocity keeps each start speed: 5 m/s above the 30 m/s limit, and none below it
    assert loop.speed_excess.tolist() == pytest.approx([5.0, 0.0], abs=0.05)
    m = closed_loop.summarize(loop, start.kind)
    assert m["speed_excess"] == pytest.approx(loop.speed_excess.mean().item())
    assert closed_loop.DIRECTIONS["speed_excess"] == "lower"


def test_the_rollout_reward_values_what_the_closed_loop_executes_of_a_plan():
    wall = custom("wall-12", agents=[(1, 12.0, 0.0)])  # 7.5 m between the bumpers at 20 m/s: hit at 0.4 s
    free = custom("open-road", lanes=2, limit=30.0, ego=(0, 30.0))
    result = score("driving-rollout", constant_speed(20.0), [wall])
    assert result.scores.item() == 0.0 and result.details["collision"].item() == 1.0  # the teacher comes too late
    # the loop executes a plan's first 0.5 s; the tracker looks 0.8 s ahead and takes speeds over
    # +-0.25 s, so plans equal up to 1.5 s score the same however they go on (the open loop differs)
    a = constant_speed(30.0)
    b = a.clone()
    b[0, 3:, 1] = torch.linspace(0.5, 3.0, HORIZON_STEPS - 3)  # drifts towards the next lane from 2 s on
    pair = score("driving-rollout", torch.cat([a, b]), [free, free])
    assert pair.scores[0] == pair.scores[1] and pair.scores[0] > 0.5
    open_loop = score("driving-carl", torch.cat([a, b]), [free, free]).scores
    assert open_loop[0] > open_loop[1]
    # a plan that leaves the 2-lane road from 2 s on: executed for 0.5 s it scores as the straight
    # one; executed for 3 s before the driver takes over it is off the road
    off = a.clone()
    off[0, 3:, 1] = torch.linspace(2.0, 8.0, HORIZON_STEPS - 3)
    short = score("driving-rollout", torch.cat([a, off]), [free, free]).scores
    longer = score("driving-rollout", torch.cat([a, off]), [free, free], execute=3.0).details
    assert short[0] == short[1] and longer["off_road"].tolist() == [0.0, 1.0] and longer["rollout"][1] == 0.0
    # speeding costs exp(-mean excess / 2), the excess measured over the plan's executed part
    fast = score("driving-rollout", constant_speed(42.0), [free], jerk_scale=8.0)
    d = fast.details
    assert d["speed_excess"].item() > 0.1
    expected = d["cl_score"] * torch.exp(-d["speed_excess"] / 2) * torch.exp(-0.5 * (d["jerk_rms"] / 8.0) ** 2)
    assert fast.scores.item() == pytest.approx(expected.item(), rel=1e-6)
    assert fast.scores.item() < pair.scores[0].item()


def test_the_rollout_prices_speeding_over_the_plan_or_over_the_whole_loop():
    # 35 m/s on a 30 m/s road, a plan that keeps 35 m/s: its executed 2 s are 5 m/s above the limit
    # throughout; the expert who takes over slows towards 30 (IDM's free term, gently), so over the
    # 8 s loop the excess is diluted (2.9 m/s)
    fast = custom("fast-35-kept", lanes=2, limit=30.0, ego=(0, 35.0))
    plan = constant_speed(35.0)
    on_plan = score("driving-rollout", plan, [fast], execute=2.0, continuation="expert").details
    on_loop = score("driving-rollout", plan, [fast], execute=2.0, continuation="expert", speeding="loop").details
    assert on_plan["speed_excess"].item() == pytest.approx(5.0, abs=1e-3)
    assert 1.0 < on_loop["speed_excess"].item() < 4.0
    # the loop is the same, only the price differs
    assert on_plan["cl_score"].item() == on_loop["cl_score"].item() > 0.9
    assert on_plan["rollout"].item() == pytest.approx(on_plan["cl_score"].item() * math.exp(-5.0 / 2), rel=1e-3)
    assert on_loop["rollout"].item() == pytest.approx(
        on_loop["cl_score"].item() * math.exp(-on_loop["speed_excess"].item() / 2), rel=1e-6
    )
    legal = score("driving-rollout", constant_speed(25.0), [custom("legal-25-kept", lanes=2, ego=(0, 25.0))])
    assert legal.details["speed_excess"].item() == 0.0


def test_the_expert_is_the_teacher_without_its_flaws():
    batch = [scenes.prompt_of("stopped", s) for s in range(6)]
    start = scenes.scenes_for(batch)
    expert = sim.without_flaws(start)
    for key, value in sim.EXPERT.items():
        assert (expert.teacher_param(key) == value).all(), key
    assert torch.equal(expert.ego, start.ego) and torch.equal(expert.agents, start.agents)
    # it sees the stopped car from 150 m and always may change lanes: it passes where the teacher hits
    teacher = closed_loop.judge(start, sim.teacher_rollout(start, 100), 10.0)
    better = closed_loop.judge(expert, sim.teacher_rollout(expert, 100), 10.0)
    assert better.collision.sum() <= teacher.collision.sum() and better.cl_score.mean() > teacher.cl_score.mean()
    pair = score("driving-rollout", constant_speed(15.0, n=2), batch[:2], continuation="expert")
    assert pair.scores.shape == (2,) and ((pair.scores >= 0) & (pair.scores <= 1)).all()


# --- bad input ------------------------------------------------------------------------------------


def test_nan_waypoints_are_one_line():
    plans = constant_speed(20.0, n=2)
    plans[1, 3, 0] = float("nan")
    for name in ("driving-pdms", "driving-rollout"):
        with pytest.raises(ValueError, match=rf"^{name}: plan 1 \(1 of 2\) has NaN or infinite waypoints; allowed: "):
            score(name, plans, ["free 1", "free 2"])
    with pytest.raises(ValueError, match=r"^driving-pdms: plans are \(2, T, 2\) waypoints"):
        score("driving-pdms", torch.zeros(2, 8), ["free 1", "free 2"])


def test_a_rollout_that_executes_the_whole_loop_is_one_line():
    _, errors = check_params(closed_loop.Rollout, {"seconds": 3.0, "execute": 3.0}, "reward")
    assert [str(e) for e in errors] == ["reward.execute: got 3; allowed: less than seconds (3)"]
    assert check_params(closed_loop.Rollout, {"seconds": 8.0, "execute": 2.0}, "reward")[1] == []


def test_bad_scenario_files_and_prompts(tmp_path):
    path = tmp_path / "scenarios.jsonl"
    path.write_text(
        '{"type": "free", "seed": 1, "lanes": 0, "speed_limit": 30, "ego": {"lane": 0, "speed": 20}}\n'
        '{"type": "free", "seed": 2, "lanes": 2, "speed_limit": 30, "ego": {"lane": 0, "speed": -3}, "agents": '
        '[{"lane": 5, "x": 10, "speed": NaN}]}\n'
    )
    with pytest.raises(prompts.ScenarioFileError) as info:
        prompts.read_scenario_file(path)
    assert info.value.problems == [
        f"{path}:1: lanes: got 0; allowed: 1 to 6 (a scene needs a lane)",
        f"{path}:2: ego.speed: got -3; allowed: a finite number from 0 to 60 (m/s)",
        f"{path}:2: agents.0.speed: got nan; allowed: a finite number from 0 to 60 (m/s)",
        f"{path}:2: agents.0.lane: got 5; allowed: an integer from 0 to 1",
    ]
    assert str(info.value) == "\n".join(info.value.problems)  # one line each
    with pytest.raises(ValueError, match="is not a driving scene"):
        scenes.parse("a red circle")
    with pytest.raises(ValueError, match="multiple of 0.5"):
        scenes.parse("free 3 t0.3")
