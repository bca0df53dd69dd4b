"""Shadow mode (``evaluator: driving-shadow``): the planner rides beside a reference driver without
acting, as a team watches a planner before it drives a car.

Every 0.5 s of a recorded drive the planner plans from the driver's state; the driver goes on as
it would have. Per plan:

- ``ade`` / ``fde``: the mean and final distance (m) between the plan's waypoints and where the
  driver actually was 0.5, 1.0, ... 4.0 s later (in the ego frame of the plan);
- ``collision``: the plan, executed by the tracking controller for its 4 s among the other cars
  driving on without seeing it (IDM, as the open-loop rewards simulate), causes a collision;
- ``ttc_under_2s``: in that simulation the time to collision falls under 2 s;
- ``driver_collision`` / ``driver_ttc_under_2s``: the same simulation of what the driver did (its
  recorded 4 s as a plan): the baseline the planner's would-be figures compare with.

``world: driving`` replays the teacher's logs of the held-out scenarios (our world; the log's
scenes at ``times``, each metric also per scenario type); ``world: highway`` drives highway-env
episodes (``highway-v0``, its seeds ``seed``, ``seed + 1``, ...) with highway-env's own IDM and
MOBIL driving the ego (wanting the road's limit), reading every 0.5 s of the first ``seconds - 4`` into a scene as
``driving-highway`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

import fgrpo.worlds.driving.scenes as scene_store
import fgrpo.worlds.driving.sim as sim
from fgrpo.core.config import param
from fgrpo.core.protocols import EvaluatorResult
from fgrpo.core.seeding import generator
from fgrpo.worlds.driving.rewards import measure
from fgrpo.worlds.driving.world import HORIZON_STEPS, MAX_SEED, PLAN_DT, TYPES, Scene

TTC_BOUND = 2.0  #: s: a time to collision under it counts
DIRECTIONS = {
    "ade": "lower",
    "fde": "lower",
    "collision": "lower",
    "ttc_under_2s": "lower",
    "driver_collision": "lower",
    "driver_ttc_under_2s": "lower",
}


def shadow_metrics(plans: torch.Tensor, driven: torch.Tensor, scenes: Scene) -> dict[str, torch.Tensor]:
    """Per plan (B,): its distance to what the driver did (``driven``, (B, T, 2) in the same ego
    frame) and the would-be collision and TTC of the plan and of the driver's own path."""
    gap = (plans[..., :2] - driven).norm(dim=-1)
    horizon = HORIZON_STEPS * PLAN_DT
    paths = sim.agent_paths(scenes, int(round(horizon / sim.DT)))
    planned, actual = measure(plans[..., :2], scenes, horizon, paths), measure(driven, scenes, horizon, paths)
    return {
        "ade": gap.mean(1),
        "fde": gap[:, -1],
        "collision": planned.collision.float(),
        "ttc_under_2s": (planned.min_ttc < TTC_BOUND).float(),
        "driver_collision": actual.collision.float(),
        "driver_ttc_under_2s": (actual.min_ttc < TTC_BOUND).float(),
    }


def means(values: dict[str, torch.Tensor], kinds: torch.Tensor | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, v in values.items():
        out[name] = v.mean().item()
        if kinds is None:
            continue
        for i, kind in enumerate(TYPES):
            mask = kinds == i
            if bool(mask.any()):
                out[f"{name}/{kind}"] = v[mask].mean().item()
    return out


def plan_scenes(context: Any, names: list[str], scenes: Scene, tag: str, batch: int = 256) -> torch.Tensor:
    """The evaluation's deterministic plans for ``scenes`` registered under ``names``."""
    scene_store.register(names, scenes)
    out = []
    for start in range(0, len(names), batch):
        chunk = names[start : start + batch]
        plans = context.generate(chunk, 1, generator(context.seed, tag, start))
        out.append(torch.as_tensor(plans).detach().float().cpu())
    return torch.cat(out)


def _times(_instance: Any, _attribute: Any, value: Any) -> None:
    limit = scene_store.MAX_LOG_TIME - HORIZON_STEPS * PLAN_DT
    if not isinstance(value, list) or not value:
        raise ValueError(f"got {value!r}; allowed: a non-empty list of times in seconds")
    for t in value:
        steps = t / PLAN_DT if isinstance(t, (int, float)) and not isinstance(t, bool) else None
        if steps is None or not 0 <= t <= limit or abs(steps - round(steps)) > 1e-9:
            raise ValueError(f"got {t!r} in {value!r}; allowed: multiples of 0.5 from 0 to {limit:g}")


@attrs.define
class ShadowEvaluator:
    """Shadow mode (see the module docstring): the planner beside a reference driver, not acting."""

    world: str = param(
        "driving", choices=("driving", "highway"), help="whose driver: the teacher's logs or highway-env"
    )
    times: list[float] = param(
        factory=lambda: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
        validator=_times,
        help="world driving: seconds into each held-out scenario's log the planner plans at",
    )
    scenarios: int = param(0, ge=0, help="world driving: held-out scenarios replayed; 0 = every test prompt")
    episodes: int = param(20, ge=1, le=10_000, help="world highway: episodes (its seeds seed, seed + 1, ...)")
    seconds: float = param(20.0, gt=4.0, le=60.0, help="world highway: length of each episode [s]")
    lanes: int = param(4, ge=2, le=6, help="world highway: lanes")
    vehicles: int = param(30, ge=0, le=100, help="world highway: other cars")
    density: float = param(1.0, gt=0.0, le=4.0, help="world highway: highway-env's vehicles_density")
    behaviour: str = param(
        "idm", choices=("idm", "aggressive", "defensive", "linear"), help="world highway: the other drivers' class"
    )
    seed: int = param(0, ge=0, le=MAX_SEED - 10_000, help="world highway: the first episode's seed")

    directions = DIRECTIONS
    category_noun = "scenario type"

    def __call__(self, context: Any) -> EvaluatorResult:
        if self.world == "highway":
            values, kinds = self._highway(context)
        else:
            values, kinds = self._logs(context)
        return EvaluatorResult(metrics=means(values, kinds))

    def _logs(self, context: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        prompts = list(context.prompts)
        prompts = prompts[: self.scenarios] if self.scenarios else prompts
        parsed = [scene_store.parse(p) for p in prompts]
        names = [scene_store.prompt_of(q.kind, q.seed, t) for t in self.times for q in parsed]
        scenes = scene_store.scenes_for(names)
        driven = scene_store.teacher_plans(names, scenes)
        plans = plan_scenes(context, [f"{n} shadow" for n in names], scenes, "shadow")
        return shadow_metrics(plans, driven, scenes), scenes.kind

    def _highway(self, context: Any) -> tuple[dict[str, torch.Tensor], None]:
        scenes, driven = highway_drives(
            self.episodes, self.seed, self.seconds, self.lanes, self.vehicles, self.density, self.behaviour
        )
        names = [
            scene_store.prompt_of("dense", int(s), float(t), "shadow")
            for s, t in zip(scenes.seed, scenes.t, strict=True)
        ]
        plans = plan_scenes(context, names, scenes, "shadow-highway")
        return shadow_metrics(plans, driven, scenes), None


def highway_drives(
    episodes: int,
    seed: int,
    seconds: float,
    lanes: int,
    vehicles: int,
    density: float = 1.0,
    behaviour: str = "idm",
) -> tuple[Scene, torch.Tensor]:
    """highway-env episodes with its IDM + MOBIL driving the ego: the scene every 0.5 s of the first
    ``seconds - 4`` s and where the ego was over the 4 s after each (B, T, 2, in that scene's ego frame)."""
    from highway_env.vehicle.behavior import IDMVehicle

    from fgrpo.worlds.driving.highway import make_env, read_scenes, step_env

    scenes: list[Scene] = []
    driven: list[torch.Tensor] = []
    per = int(round(PLAN_DT / sim.DT))
    rounds = int(round((seconds - HORIZON_STEPS * PLAN_DT) / PLAN_DT))
    for episode in range(seed, seed + episodes):
        env = make_env(lanes, vehicles, seconds, density, behaviour)
        try:
            env.reset(seed=episode)
            base = env.unwrapped
            # highway-env's own driver takes the wheel, wanting the road's limit
            was = base.vehicle
            lane = base.road.network.get_lane(was.lane_index)
            ego = IDMVehicle(base.road, was.position, was.heading, was.speed, was.lane_index, float(lane.speed_limit))
            base.road.vehicles[base.road.vehicles.index(base.vehicle)] = ego
            base.controlled_vehicles = [ego]
            states: list[Scene] = []
            positions: list[torch.Tensor] = []
            speeds: list[float] = []
            for step in range((rounds + HORIZON_STEPS) * per + 1):
                if step % per == 0:
                    accel = (speeds[-1] - speeds[-2]) / sim.DT if len(speeds) > 1 else 0.0
                    states.append(read_scenes([env], torch.tensor([accel]), step * sim.DT, [episode]))
                # our frame is highway-env's shifted by half a lane (as read_scenes reads it)
                shift = float(states[0].lane_width[0]) / 2
                positions.append(torch.tensor([float(ego.position[0]), float(ego.position[1]) + shift]))
                speeds.append(float(ego.speed))
                if ego.crashed:
                    break
                step_env(env, env.action_space.sample() * 0)
        finally:
            env.close()
        path = torch.stack(positions)
        for r in range(min(rounds, len(states))):
            future = path[(r + 1) * per : (r + 1 + HORIZON_STEPS) * per : per]
            if len(future) < HORIZON_STEPS:
                break
            scenes.append(states[r])
            driven.append(sim.world_to_frame(future[None], states[r].ego)[0])
    return Scene.cat(scenes), torch.stack(driven)


__all__: Sequence[str] = ("ShadowEvaluator", "highway_drives", "shadow_metrics")
