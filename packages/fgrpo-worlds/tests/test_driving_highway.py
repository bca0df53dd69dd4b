"""``driving-highway``: highway-env read into driving-world scenes, our tracker's actions carried
into highway-env's bicycle, and the closed loop measured there (hand cases: a car standing in the
ego's lane is hit at a known time by a plan that keeps its speed and not by one that stops)."""

from __future__ import annotations

import math

import pytest
import torch

from fgrpo.worlds.driving import features, highway, sim
from fgrpo.worlds.driving.world import PLAN_DT, WHEELBASE, lane_centre, nearest_lane

pytest.importorskip("highway_env")

T = torch.arange(1, 9, dtype=torch.float32) * PLAN_DT


def env_with(vehicles: list[tuple[int, float, float]], seed: int = 0, lanes: int = 3, ego=(1, 20.0)):
    """A highway-v0 env whose traffic is replaced by ``vehicles`` (lane, metres ahead of the ego,
    speed; a speed of 0 stands still), the ego at the start of lane ``ego[0]`` at ``ego[1]`` m/s."""
    from highway_env.vehicle.behavior import IDMVehicle

    env = highway.make_env(lanes, 0, 10.0)
    env.reset(seed=seed)
    u = env.unwrapped
    road = u.road
    lane = road.network.get_lane(("0", "1", ego[0]))
    u.vehicle.position = lane.position(100.0, 0.0)
    u.vehicle.heading, u.vehicle.speed = 0.0, ego[1]
    u.vehicle.on_state_update()
    road.vehicles = [u.vehicle]
    for lane_id, ahead, speed in vehicles:
        other = IDMVehicle(road, road.network.get_lane(("0", "1", lane_id)).position(100.0 + ahead, 0.0), 0.0, speed)
        other.target_speed = speed
        road.vehicles.append(other)
    return env


def test_steering_turns_both_bicycles_at_the_same_rate():
    from highway_env.vehicle.kinematics import Vehicle

    steer = torch.tensor([-0.3, -0.05, 0.0, 0.02, 0.2])
    ours = torch.tan(steer) / WHEELBASE  # yaw rate per m/s of our bicycle
    delta = highway.highway_steering(steer)
    theirs = torch.sin(torch.atan(torch.tan(delta) / 2)) / (Vehicle.LENGTH / 2)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.equal(torch.sign(delta), torch.sign(steer))


def test_a_highway_state_reads_as_a_scene_in_our_frame():
    env = env_with([(1, 30.0, 15.0), (2, -10.0, 25.0)])
    scene = highway.read_scenes([env], torch.tensor([0.7]), 0.0, [0])
    width = float(scene.lane_width[0])
    assert width == 4.0 and scene.lanes.tolist() == [3.0] and scene.speed_limit.tolist() == [30.0]
    # our lane i is centred at (i + 0.5) W: highway-env's lane 1 (y = 4) is our lane 1 (y = 6)
    assert scene.ego[0].tolist() == pytest.approx([100.0, 6.0, 0.0, 20.0, 0.7])
    assert nearest_lane(scene.ego[:, 1], scene.lanes, scene.lane_width).item() == 1.0
    cars = scene.agents[scene.valid]
    centre_2 = lane_centre(torch.tensor(2.0), torch.tensor(4.0)).item()
    assert [c for car in sorted(cars[:, :2].tolist()) for c in car] == pytest.approx([90.0, centre_2, 130.0, 6.0])
    f = features.encode(scene)[0]
    # the slot "ahead in the ego's lane": present, bumper gap (30 - 4.5) / 50, speed -5 / 10
    assert f[8:11].tolist() == pytest.approx([1.0, 25.5 / 50, -0.5], abs=1e-6)
    env.close()


def test_a_lateral_speed_reaches_the_scene_encoding():
    env = env_with([(1, 30.0, 20.0)])
    car = env.unwrapped.road.vehicles[1]
    car.heading = math.asin(1.0 / 20.0)  # 1 m/s towards the next lane
    scene = highway.read_scenes([env], torch.zeros(1), 2.0, [0])
    assert sim.scripted_y(scene, scene.t + 0.5)[0, 0].item() == pytest.approx(6.0 + 0.5, abs=1e-5)
    assert features.encode(scene)[0, 12].item() == pytest.approx(1.0 / 2.0, abs=1e-5)  # lateral speed / 2
    env.close()


def keep_speed(scene, _round):
    return torch.stack([scene.ego[:, 3:4] * T, torch.zeros(len(scene), 8)], -1)


def stop_at(x_stop: float):
    """Plans that brake evenly from the scene's speed to a stop at ``x_stop`` on the road."""

    def plan(scene, _round):
        v = scene.ego[:, 3:4]
        metres = (x_stop - scene.ego[:, 0:1]).clamp_min(0.5)
        decel = (v**2 / (2 * metres)).clamp_min(1e-6)
        t = torch.minimum(T[None], v / decel)
        x = v * t - 0.5 * decel * t**2
        return torch.stack([x, torch.zeros(len(scene), 8)], -1)

    return plan


def test_a_standing_car_is_hit_at_the_time_the_geometry_says():
    # 20 m/s towards a car standing 30 m ahead (centre to centre; both cars 5 m long): the bumpers
    # meet after 25 m, at 1.25 s
    hit = highway.drive_highway(keep_speed, [env_with([(1, 30.0, 0.0)])], [0], 3.0)
    assert hit.collision.tolist() == [True]
    assert (hit.collision_step.item() + 1) * sim.DT == pytest.approx(1.25, abs=0.1 + 1e-9)
    assert hit.cl_score.tolist() == [0.0]
    # the same car 40 m ahead (35 m between the bumpers) and plans that brake evenly to a stop 20 m
    # from the start (replanned from each new state): the tracker, which lags the plan and creeps
    # on to each new stop point, leaves the ego about 33 m on, short of the car
    safe = highway.drive_highway(stop_at(120.0), [env_with([(1, 40.0, 0.0)])], [0], 5.0)
    assert safe.collision.tolist() == [False] and safe.off_road.tolist() == [False]
    assert 20.0 < float(safe.path[0, -1, 0] - safe.path[0, 0, 0]) < 35.0
    assert safe.path[0, -1, 0] - safe.path[0, -6, 0] < 1.0  # under 2 m/s over the last half second


def test_an_empty_road_at_constant_speed():
    drive = highway.drive_highway(keep_speed, [env_with([], ego=(0, 25.0))], [0], 4.0)
    m = {k: v.item() for k, v in drive.metrics().items()}
    assert m["collision"] == 0.0 and m["off_road"] == 0.0 and m["stuck"] == 0.0
    assert m["speed"] == pytest.approx(25.0, abs=0.05) and m["jerk"] == pytest.approx(0.0, abs=0.05)
    # 100 m in 4 s; the free-road distance accelerates at 1.5 m/s^2 from 25 to the limit of 30 (91.67 m
    # in 3.33 s) and keeps it (20 m): 111.67 m
    assert m["progress"] == pytest.approx(100.0 / 111.667, abs=2e-3) and m["cl_score"] == m["progress"]
    assert m["speed_excess"] == 0.0


def test_a_car_leaving_the_road_is_off_road():
    def swerve(scene, _round):  # towards lane -1, off the right edge of a 3-lane road
        return torch.stack([scene.ego[:, 3:4] * T, -1.5 * T[None].expand(len(scene), -1)], -1)

    drive = highway.drive_highway(swerve, [env_with([], ego=(0, 20.0))], [0], 4.0)
    assert drive.off_road.tolist() == [True] and drive.cl_score.tolist() == [0.0]


def test_each_car_is_read_with_its_own_idm_parameters():
    env = env_with([(1, 30.0, 15.0), (2, -10.0, 25.0)])
    car = env.unwrapped.road.vehicles[1]
    car.target_speed, car.TIME_WANTED = 17.0, 1.1
    scene = highway.read_scenes([env], torch.zeros(1), 0.0, [0])
    row = scene.idm[0, (scene.agents[0, :, 0] - 130.0).abs() < 1e-3][0]
    # highway-env's gap of 10 m centre to centre is ours 5 m bumper to bumper for its 5 m cars
    assert row.tolist() == pytest.approx([17.0, 1.1, 10.0 - car.LENGTH, 3.0, 5.0])
    # our traffic then drives it by that IDM: free road, it accelerates towards 17 m/s at most 3 m/s^2
    a = sim.idm_acceleration(torch.tensor(15.0), torch.tensor(math.inf), torch.tensor(0.0), row)
    assert a.item() == pytest.approx(3.0 * (1 - (15.0 / 17.0) ** 4), rel=1e-5)
    env.close()


@pytest.mark.parametrize(("behaviour", "cls"), [("aggressive", "AggressiveVehicle"), ("linear", "LinearVehicle")])
def test_configurations_set_density_and_the_drivers_class(behaviour, cls):
    env = highway.make_env(3, 12, 5.0, density=2.0, behaviour=behaviour)
    env.reset(seed=4)
    others = [v for v in env.unwrapped.road.vehicles if v is not env.unwrapped.vehicle]
    assert len(others) == 12 and {type(v).__name__ for v in others} == {cls}
    assert env.unwrapped.config["vehicles_density"] == 2.0
    env.close()


def test_highway_starts_are_the_states_of_highway_envs_own_driver_registered_as_prompts():
    from fgrpo.worlds.driving import highway_starts, scenes, shadow

    spec = {"episodes": 1, "seed": 5, "seconds": 5.0, "configs": [{"lanes": 3, "vehicles": 6}]}
    names = highway_starts.register_starts(spec)
    assert names == ["dense 5 t0 highway0", "dense 5 t0.5 highway0"]  # every 0.5 s of the first 5 - 4 s
    expected, _ = shadow.highway_drives(1, 5, 5.0, 3, 6)
    got = scenes.scenes_for(names)
    assert torch.equal(got.ego, expected.ego) and torch.equal(got.idm, expected.idm)
    assert (got.idm[got.valid][:, 0] > 0).all()  # every car read with a desired speed of its own


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"episodes": 0}, "episodes: got 0; allowed: an integer from 1 to 1000"),
        ({"configs": [{"lanes": 9}]}, "configs.0.lanes: got 9; allowed: a number from 2 to 6"),
        ({"configs": [{"behaviour": "polite"}]}, "configs.0.behaviour: got 'polite'; allowed: idm, aggressive"),
        ({"every": 1}, "every: unknown key"),
    ],
)
def test_bad_highway_starts_are_one_line(value, message):
    from fgrpo.worlds.driving import highway_starts

    with pytest.raises(ValueError, match=message):
        highway_starts.validate(None, None, value)


def test_stepping_without_observations_is_highway_envs_own_step():
    import numpy as np

    envs = [highway.make_env(3, 10, 5.0) for _ in range(2)]
    for env in envs:
        env.reset(seed=11)
    for k in range(15):
        action = np.array([0.2 * math.sin(k), 0.1 * math.cos(k)])
        envs[0].step(action)
        highway.step_env(envs[1], action)
    a, b = (env.unwrapped for env in envs)
    assert a.time == b.time and a.steps == b.steps
    for u, v in zip(a.road.vehicles, b.road.vehicles, strict=True):
        assert np.array_equal(u.position, v.position) and u.speed == v.speed and u.heading == v.heading
    for env in envs:
        env.close()
