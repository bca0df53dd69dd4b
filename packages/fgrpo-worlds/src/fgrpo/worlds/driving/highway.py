"""``driving-highway`` (extra ``[highway]``): the planner driven closed-loop in highway-env, a check
of the gold by a simulator that is not ours.

`highway-env <https://github.com/Farama-Foundation/HighwayEnv>`_'s ``highway-v0`` task: a straight
road of ``lanes`` lanes 4 m wide with a 30 m/s limit, ``vehicles`` cars driven by its own IDM and
MOBIL that react to the ego, the ego a kinematic bicycle with its own geometry (5 x 2 m) and its own
collision test. It runs offline and headless (it draws nothing unless asked). Every 0.5 s each
episode's state is read into a driving-world :class:`~fgrpo.worlds.driving.world.Scene` (the road,
the ego, the :data:`~fgrpo.worlds.driving.world.MAX_AGENTS` nearest cars with their lateral
speeds), the policy plans from it as from any scene, and the tracking controller that executes
plans in our world (:func:`~fgrpo.worlds.driving.sim.track`) executes the plan's first 0.5 s as
highway-env's continuous actions at 10 Hz (the steering angle converted so that both bicycles turn
at the same rate). Episodes are highway-env's seeds ``seed``, ``seed + 1``, ...: the same at every
evaluation.

Per episode, as the closed loop measures ours (:mod:`fgrpo.worlds.driving.closed_loop`):
``collision`` (highway-env's own crash flag), ``off_road`` (a corner of the ego's box off the
road), ``progress`` (distance over the free-road distance), ``stuck``, ``jerk``, ``speed``,
``speed_excess`` and ``cl_score``; their means are the evaluator's metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

import fgrpo.worlds.driving.safety as safety
import fgrpo.worlds.driving.scenes as scene_store
import fgrpo.worlds.driving.sim as sim
from fgrpo.core.config import param
from fgrpo.core.protocols import EvaluatorResult
from fgrpo.worlds.driving.closed_loop import DIRECTIONS, LIMITS, REPLAN, Drive, evaluation_planner, pictures
from fgrpo.worlds.driving.rewards import free_distance, speed_excess
from fgrpo.worlds.driving.world import (
    HORIZON_STEPS,
    MAX_AGENTS,
    MAX_SEED,
    TEACHER_KEYS,
    TYPES,
    WHEELBASE,
    Scene,
)

#: the scenario type the highway scenes are registered under (a prompt needs one; it names nothing)
KIND = TYPES.index("dense")
SIGHT = 100.0  #: m ahead and behind within which cars are read into the scene


#: highway-env's classes of other drivers (``other_vehicles_type``), by the name a recipe gives
BEHAVIOURS = {
    "idm": "highway_env.vehicle.behavior.IDMVehicle",
    "aggressive": "highway_env.vehicle.behavior.AggressiveVehicle",
    "defensive": "highway_env.vehicle.behavior.DefensiveVehicle",
    "linear": "highway_env.vehicle.behavior.LinearVehicle",
}


def make_env(lanes: int, vehicles: int, seconds: float, density: float = 1.0, behaviour: str = "idm") -> Any:
    """highway-env's ``highway-v0`` at 10 Hz with continuous actions in our acceleration and
    steering ranges; ``density`` its ``vehicles_density``, ``behaviour`` a key of :data:`BEHAVIOURS`."""
    try:
        import gymnasium
        import highway_env  # noqa: F401  (registers the highway-v0 task)
    except ImportError as exc:
        raise ImportError('evaluator driving-highway needs highway-env: pip install "fgrpo-worlds[highway]"') from exc
    config = {
        "observation": {"type": "Kinematics"},
        "action": {
            "type": "ContinuousAction",
            "acceleration_range": (sim.A_MIN, sim.A_MAX),
            "steering_range": (-math.pi / 4, math.pi / 4),
        },
        "simulation_frequency": int(round(1 / sim.DT)),
        "policy_frequency": int(round(1 / sim.DT)),
        "lanes_count": lanes,
        "vehicles_count": vehicles,
        "vehicles_density": density,
        "other_vehicles_type": BEHAVIOURS[behaviour],
        "duration": seconds + 1.0,
        "offscreen_rendering": True,
    }
    return gymnasium.make("highway-v0", config=config)


def step_env(env: Any, action: Any) -> None:
    """highway-env's ``step`` without its observation, reward and info: the same simulation
    (``AbstractEnv.step`` = clock, ``_simulate``, then those three, which change nothing), for half
    the time; every reader here takes the state from the road itself."""
    base = env.unwrapped
    base.time += 1 / base.config["policy_frequency"]
    base._simulate(action)


def highway_steering(steer: torch.Tensor) -> torch.Tensor:
    """Our bicycle's steering angle -> highway-env's that turns the car at the same rate.

    Ours turns at v tan(steer) / WHEELBASE; highway-env's at v sin(beta) / (L / 2) with
    beta = atan(tan(delta) / 2) and L = 5 m, so sin(beta) = tan(steer) L / (2 WHEELBASE)."""
    from highway_env.vehicle.kinematics import Vehicle

    s = (torch.tan(steer) * Vehicle.LENGTH / (2 * WHEELBASE)).clamp(-0.999, 0.999)
    return torch.atan(2 * torch.tan(torch.asin(s)))


def idm_parameters(vehicle: Any) -> list[float]:
    """A highway-env car's IDM as ours reads it: (desired speed, time headway, minimum bumper gap,
    maximum acceleration, comfortable deceleration). highway-env's minimum gap is centre to centre
    (``DISTANCE_WANTED``), ours bumper to bumper; a car without an IDM of its own keeps its speed."""
    speed = float(vehicle.speed)
    return [
        float(getattr(vehicle, "target_speed", speed) or speed),
        float(getattr(vehicle, "TIME_WANTED", 1.5)),
        max(float(getattr(vehicle, "DISTANCE_WANTED", 10.0)) - float(vehicle.LENGTH), 0.5),
        float(getattr(vehicle, "COMFORT_ACC_MAX", 3.0)),
        -float(getattr(vehicle, "COMFORT_ACC_MIN", -5.0)),
    ]


def read_scenes(envs: Sequence[Any], accel: torch.Tensor, t: float, episodes: Sequence[int]) -> Scene:
    """Each env's state as a driving-world scene: our frame is highway-env's shifted by half a lane
    (our lane i is centred at (i + 0.5) W, highway-env's at i W), headings and speeds as they are,
    each car's IDM parameters its own (:func:`idm_parameters`)."""
    rows = []
    for env, a, episode in zip(envs, accel.tolist(), episodes, strict=True):
        road = env.unwrapped.road
        ego_vehicle = env.unwrapped.vehicle
        lane = road.network.get_lane(ego_vehicle.lane_index)
        width, limit = float(lane.width), float(lane.speed_limit)
        lanes = len(road.network.graph["0"]["1"])
        x, y = (float(c) for c in ego_vehicle.position)
        ego = torch.tensor([[x, y + width / 2, ego_vehicle.heading, ego_vehicle.speed, a]])
        others = [v for v in road.vehicles if v is not ego_vehicle and abs(float(v.position[0]) - x) < SIGHT]
        others = sorted(others, key=lambda v: abs(float(v.position[0]) - x))[:MAX_AGENTS]
        agents = torch.zeros(1, MAX_AGENTS, 4)
        agents[..., 0] = 1.0e4
        valid = torch.zeros(1, MAX_AGENTS, dtype=torch.bool)
        lane_change = torch.zeros(1, MAX_AGENTS, 4)
        idm = torch.zeros(1, MAX_AGENTS, 5)
        for i, v in enumerate(others):
            idm[0, i] = torch.tensor(idm_parameters(v))
            oy = float(v.position[1]) + width / 2
            agents[0, i] = torch.tensor([float(v.position[0]), oy, v.heading, v.speed])
            valid[0, i] = True
            # the scene encoding reads a car's lateral speed off its scripted lane change half a
            # second ahead: a smoothstep over 1 s is halfway there, so it moves 0.5 s x its lateral speed
            lateral = float(v.speed) * math.sin(float(v.heading))
            lane_change[0, i] = torch.tensor([oy, oy + lateral, t, 1.0])
        rows.append(
            Scene(
                t=torch.tensor([t]),
                ego=ego.float(),
                agents=agents,
                valid=valid,
                idm=idm,
                lane_change=lane_change,
                road=torch.tensor([[float(lanes), width, limit]]),
                teacher=torch.tensor([[sim.EXPERT[k] for k in TEACHER_KEYS]]),
                kind=torch.tensor([KIND]),
                seed=torch.tensor([episode]),
                previous_plan=torch.full((1, HORIZON_STEPS, 2), float("nan")),
            )
        )
    return Scene.cat(rows)


def act(
    envs: Sequence[Any], accel: torch.Tensor, steer: torch.Tensor, live: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One highway-env step of every live env under our (acceleration, steering): (the crash flags,
    the accelerations applied). A stop does not go on braking into reverse, as in our bicycle
    (highway-env's cars may reverse)."""
    import numpy as np

    crashed = torch.zeros(len(envs), dtype=torch.bool)
    speeds = torch.tensor([float(env.unwrapped.vehicle.speed) for env in envs])
    accel = torch.maximum(accel.clamp(sim.A_MIN, sim.A_MAX), -speeds / sim.DT)
    wheel = highway_steering(steer)
    span = (sim.A_MAX - sim.A_MIN) / 2
    for i, env in enumerate(envs):
        if not live[i]:
            continue
        action = np.array([(float(accel[i]) - sim.A_MIN) / span - 1.0, float(wheel[i]) / (math.pi / 4)])
        step_env(env, action)
        crashed[i] = bool(env.unwrapped.vehicle.crashed)
    return crashed, accel


def drive_highway(planner: Any, envs: Sequence[Any], episodes: Sequence[int], seconds: float) -> Drive:
    """The closed loop in highway-env: every ``REPLAN`` s a plan per episode, its first ``REPLAN`` s
    executed by the tracking controller; an episode stops at its first crash."""
    n = len(envs)
    accel = torch.zeros(n)
    start = read_scenes(envs, accel, 0.0, episodes)
    scene = start
    live = torch.ones(n, dtype=torch.bool)
    first = torch.full((n,), -1, dtype=torch.long)
    off = torch.zeros(n, dtype=torch.bool)
    egos, accels = [start.ego], [accel]
    per = int(round(REPLAN / sim.DT))
    for r in range(int(round(seconds / REPLAN))):
        plans = planner(scene, r)
        reference = sim.Reference.of(sim.plan_path(plans[..., :2], scene.ego), per)
        for k in range(per):
            a, steer = sim.track(scene.ego, reference, k)
            crashed, applied = act(envs, a, steer, live)
            accel = torch.where(live, applied, accels[-1])  # a stopped episode's car keeps its last reading
            step = len(egos) - 1
            scene = read_scenes(envs, accel, (step + 1) * sim.DT, episodes)
            ego = torch.where(live[:, None], scene.ego, egos[-1])
            off |= live & sim.off_road(ego, scene.lanes, scene.lane_width)
            first = torch.where(crashed & (first < 0), torch.full_like(first, step), first)
            live &= ~crashed
            egos.append(ego)
            accels.append(accel)
        scene = scene.replace(ego=egos[-1])
    ego_path = torch.stack(egos, 1)
    accel_path = torch.stack(accels, 1)
    distance = ego_path[:, -1, 0] - ego_path[:, 0, 0]
    progress = distance / free_distance(start.ego[:, 3], start.speed_limit, seconds).clamp_min(1.0)
    speeds = ego_path[:, 1:, 3]
    return Drive(
        collision=first >= 0,
        collision_step=first,
        off_road=off,
        progress=progress.clamp(0.0, 1.0),
        mean_speed=speeds.mean(1),
        speed_excess=speed_excess(speeds, start.speed_limit),
        jerk=((accel_path[:, 1:] - accel_path[:, :-1]) / sim.DT).pow(2).mean(1).sqrt(),
        path=ego_path[..., :2],
        start=start,
        end=scene,
        snapshots={},
    )


MAX_EPISODES = 10_000


@attrs.define
class HighwayEvaluator:
    """The planner driven closed-loop in highway-env's ``highway-v0`` (``evaluator:
    driving-highway``, extra ``[highway]``): ``episodes`` episodes of ``seconds`` s among
    ``vehicles`` reactive cars on ``lanes`` lanes, replanning at 2 Hz with the evaluation's
    deterministic sampler; collision, off-road, progress, stuck, jerk, speed, speeding and
    CL-score, as the gold measures our world (see the module docstring)."""

    episodes: int = param(100, ge=1, le=MAX_EPISODES, help="highway-env episodes (its seeds seed, seed + 1, ...)")
    seconds: float = param(20.0, gt=0.0, le=60.0, help="length of each episode [s]")
    lanes: int = param(4, ge=2, le=6, help="lanes of the road")
    vehicles: int = param(30, ge=0, le=100, help="other cars")
    density: float = param(1.0, gt=0.0, le=4.0, help="highway-env's vehicles_density (1: its default spacing)")
    behaviour: str = param("idm", choices=tuple(BEHAVIOURS), help="the other drivers' highway-env class")
    # every episode's seed, seed + episodes - 1 the last, names a scene (an int64 Scene.seed)
    seed: int = param(0, ge=0, le=MAX_SEED - MAX_EPISODES, help="the first episode's highway-env seed")
    pictures: int = param(2, ge=0, help="episodes drawn for the report (their executed paths)")
    safety_filter: dict | None = param(None, validator=safety.validate, help=safety.HELP)

    directions = DIRECTIONS
    category_noun = "scenario type"
    limits = LIMITS

    def __call__(self, context: Any) -> EvaluatorResult:
        episodes = list(range(self.seed, self.seed + self.episodes))
        envs = [make_env(self.lanes, self.vehicles, self.seconds, self.density, self.behaviour) for _ in episodes]
        try:
            for env, episode in zip(envs, episodes, strict=True):
                env.reset(seed=episode)
            planner, tally = evaluation_planner(context, "highway", self.safety_filter)
            result = drive_highway(planner, envs, episodes, self.seconds)
        finally:
            for env in envs:
                env.close()
        metrics = {name: values.float().mean().item() for name, values in result.metrics().items()}
        metrics |= tally.metrics() if tally is not None else {}
        names = [scene_store.prompt_of(KIND, e, 0.0, "highway") for e in episodes]
        return EvaluatorResult(metrics=metrics, pictures=pictures(result, names, self.pictures))
