"""The closed loop: a planner drives a scenario among reactive traffic, replanning at 2 Hz; and the
``driving-closed-loop`` evaluator, the driving world's gold metric.

Every ``replan`` s (0.5) the planner is asked for a plan from the current scene (registered under
a prompt of its own, so a policy encodes it as any scene); the tracking controller executes its
first ``replan`` s while the other cars drive by IDM and see the ego (they brake for it). Per
scenario the evaluator measures (over ``seconds``, 12 by default):

- ``collision``: the ego's box overlapped a car's at some step (any fault: in the closed loop the
  others react, so a collision is the ego's failure);
- ``off_road``: a corner of the ego left the road at some step;
- ``progress``: distance along the road / the free-road distance (accelerating at 1.5 m/s^2 up to
  the speed limit), clipped to 1;
- ``stuck``: mean speed under 2 m/s;
- ``jerk``: RMS jerk of the ego's longitudinal acceleration (m/s^3);
- ``cl_score`` = (no collision) x (on road) x progress, the headline;
- ``speed``: mean speed (m/s);
- ``speed_excess``: mean speed above the scenario's limit (m/s; 0 for a driver that keeps it);
- ``pass_rate``: the world's pass rule, the verdict on a picture's badge (``passes``): no
  collision, on the road, not stuck, at most 1 m/s above the limit on average and an RMS jerk
  within nuPlan's comfort bound, so a CL-score of 1 at 35 m/s on a 25 m/s road fails
  (``rewards.PASS_RULE``).

Each metric also per scenario type (``cl_score/cut-in`` ...). Lower is better for collision,
off_road, stuck, jerk and speed_excess (``directions``); the CL-score, collisions, speed above
the limit and jerk are the world's limits (``LIMITS``), which the over-optimisation guard watches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

import fgrpo.worlds.driving.safety as safety
import fgrpo.worlds.driving.scenes as scene_store
import fgrpo.worlds.driving.sim as sim
from fgrpo.core.config import ConfigError, param
from fgrpo.core.protocols import EvaluatorResult, Picture, RewardResult
from fgrpo.core.seeding import generator
from fgrpo.worlds.driving.draw import frame_times
from fgrpo.worlds.driving.rewards import (
    STUCK_SPEED,
    DrivingTerm,
    check_plans,
    free_distance,
    jerk_factor,
    passes,
    reading,
    speed_excess,
    speeding_factor,
)
from fgrpo.worlds.driving.world import TYPES, Scene

#: a planner: (scenes, the replanning round) -> plans (B, T, 2) in each scene's ego frame
Planner = Callable[[Scene, int], torch.Tensor]
METRICS = ("cl_score", "collision", "off_road", "progress", "stuck", "jerk", "speed", "speed_excess", "pass_rate")
DIRECTIONS = {
    "pass_rate": "higher",
    "cl_score": "higher",
    "progress": "higher",
    "speed": "higher",
    "collision": "lower",
    "off_road": "lower",
    "stuck": "lower",
    "jerk": "lower",
    "speed_excess": "lower",
}
#: the gold metrics the driving world names as limits, watched by the over-optimisation guard
#: (``eval.guard: {}``), with the smallest change of each that counts (the evaluation's own
#: noise: one CL-score on the 1000 held-out scenarios has a standard error of about 0.013)
LIMITS = {"cl_score": 0.01, "collision": 0.01, "speed_excess": 0.1, "jerk": 0.25}
REPLAN = 0.5  #: s between two plans in the closed loop


@attrs.frozen
class Drive:
    """What one closed loop did (every (B,) unless said otherwise)."""

    collision: torch.Tensor  # bool
    collision_step: torch.Tensor  # long, -1 without collision
    off_road: torch.Tensor  # bool
    progress: torch.Tensor  # ratio in [0, 1]
    mean_speed: torch.Tensor
    speed_excess: torch.Tensor  # mean speed above the start's limit, m/s
    jerk: torch.Tensor  # RMS, m/s^3
    path: torch.Tensor  # (B, S + 1, 2) world-frame positions
    start: Scene
    end: Scene
    snapshots: dict[float, Scene]  # the scenes at the requested replanning times

    @property
    def collision_time(self) -> torch.Tensor:
        """s after the start at the end of the first step in collision; inf without one."""
        return torch.where(
            self.collision, (self.collision_step + 1) * sim.DT, torch.full_like(self.progress, math.inf)
        )

    @property
    def cl_score(self) -> torch.Tensor:
        return (~self.collision).float() * (~self.off_road).float() * self.progress

    @property
    def passed(self) -> torch.Tensor:
        """The world's pass rule (:data:`fgrpo.worlds.driving.rewards.PASS_RULE`), per drive."""
        return passes(self.collision, self.off_road, self.mean_speed, self.speed_excess, self.jerk)

    def metrics(self) -> dict[str, torch.Tensor]:
        return {
            "cl_score": self.cl_score,
            "collision": self.collision.float(),
            "off_road": self.off_road.float(),
            "progress": self.progress,
            "stuck": (self.mean_speed < STUCK_SPEED).float(),
            "jerk": self.jerk,
            "speed": self.mean_speed,
            "speed_excess": self.speed_excess,
            "pass_rate": self.passed.float(),
        }


def drive(
    planner: Planner, start: Scene, seconds: float = 12.0, replan: float = REPLAN, keep: Sequence[float] = ()
) -> Drive:
    """Run the closed loop from ``start`` (see the module docstring); ``keep``: times (s after the
    start, multiples of ``replan``) whose scenes :attr:`Drive.snapshots` holds (the plan made
    before each is its ``previous_plan``)."""
    rounds = int(round(seconds / replan))
    scene = start
    executed: list[Scene] = []
    snapshots: dict[float, Scene] = {}
    wanted = {round(t / replan): t for t in keep}
    for r in range(rounds):
        if r in wanted:
            snapshots[wanted[r]] = scene
        plans = planner(scene, r)
        made = sim.plan_to_world(plans[..., :2], scene.ego)
        scene, steps = sim.execute(scene, plans[..., :2], replan)
        executed += steps
        # the plan made at this round is the next scene's previous plan: waypoints at its time on
        scene = scene.replace(previous_plan=made)
    if rounds in wanted:
        snapshots[wanted[rounds]] = scene
    return judge(start, executed, seconds, snapshots)


def judge(start: Scene, steps: Sequence[Scene], seconds: float, snapshots: dict[float, Scene] | None = None) -> Drive:
    """What the ego did in the scenes ``steps`` (one per DT from ``start`` on, ``seconds`` in all)."""
    collided = torch.zeros(len(start), dtype=torch.bool)
    first = torch.full((len(start),), -1, dtype=torch.long)
    off = torch.zeros(len(start), dtype=torch.bool)
    accels, path, speeds = [start.ego[:, 4]], [start.ego[:, :2]], []
    for step, s in enumerate(steps):
        hit = sim.collisions(s.ego, s.agents, s.valid, at_fault_only=False)
        first = torch.where(hit & ~collided, torch.full_like(first, step), first)
        collided |= hit
        off |= sim.off_road(s.ego, s.lanes, s.lane_width)
        accels.append(s.ego[:, 4])
        path.append(s.ego[:, :2])
        speeds.append(s.ego[:, 3])
    accel = torch.stack(accels, 1)
    jerk = ((accel[:, 1:] - accel[:, :-1]) / sim.DT).pow(2).mean(1).sqrt()
    position = torch.stack(path, 1)
    distance = position[:, -1, 0] - position[:, 0, 0]
    progress = (distance / free_distance(start.ego[:, 3], start.speed_limit, seconds).clamp_min(1.0)).clamp(0.0, 1.0)
    speed = torch.stack(speeds, 1)
    return Drive(
        collision=collided,
        collision_step=first,
        off_road=off,
        progress=progress,
        mean_speed=speed.mean(1),
        speed_excess=speed_excess(speed, start.speed_limit),
        jerk=jerk,
        path=position,
        start=start,
        end=steps[-1],
        snapshots=snapshots or {},
    )


def policy_planner(generate: Callable[..., Any], tag: str, seed: int, per_scene: int = 1) -> Planner:
    """A planner from an evaluation's ``generate(prompts, per_prompt, generator)``: each scene is
    registered under ``"<type> <seed> t<round> <tag>"`` and generated like a prompt (one plan, or
    ``per_scene`` plans (B, per_scene, T, 2); the noise seeded by (seed, tag, round): the same at
    every evaluation)."""

    def plan(scenes: Scene, round_: int) -> torch.Tensor:
        names = [
            f"{TYPES[int(k)]} {int(s)} t{round_ * 0.5:g} {tag}-{i}"
            for i, (k, s) in enumerate(zip(scenes.kind, scenes.seed, strict=True))
        ]
        scene_store.register(names, scenes)
        plans = torch.as_tensor(generate(names, per_scene, generator(seed, tag, round_))).detach().float().cpu()
        return plans if per_scene == 1 else plans.reshape(len(scenes), per_scene, *plans.shape[1:])

    return plan


def evaluation_planner(context: Any, tag: str, filter_value: Any) -> tuple[Planner, safety.Interventions | None]:
    """The policy as an evaluation drives it: alone, or behind the safety filter an evaluator's
    ``safety_filter`` sets (:mod:`fgrpo.worlds.driving.safety`), whose candidates are the very plan
    the policy alone would execute, ``candidates - 1`` more draws and, with ``base``, the
    behaviour-cloning base's plan (the policy's reference network)."""
    own = policy_planner(context.generate, tag, context.seed)
    chosen = safety.build(filter_value)
    if chosen is None:
        return own, None
    more = policy_planner(context.generate, f"{tag}-more", context.seed, chosen.candidates - 1)
    base = policy_planner(context.generate, f"{tag}-base", context.seed)

    def candidates(scenes: Scene, round_: int) -> torch.Tensor:
        plans = [own(scenes, round_)[:, None]]
        if chosen.candidates > 1:
            plans.append(more(scenes, round_))
        if chosen.base:
            with context.policy.reference():
                plans.append(base(scenes, round_)[:, None])
        return torch.cat(plans, 1)

    tally = safety.Interventions()
    return safety.filtered_planner(candidates, chosen, tally), tally


def teacher_planner(scenes: Scene, _round: int) -> torch.Tensor:
    """The teacher as a planner: its own 4 s plan from each scene (for comparisons)."""
    return sim.teacher_plan(scenes)


def constant_velocity_planner(scenes: Scene, _round: int) -> torch.Tensor:
    t = torch.arange(1, 9, dtype=torch.float32) * 0.5
    return torch.stack([scenes.ego[:, 3:4] * t, torch.zeros(len(scenes), 8)], -1)


def summarize(drive_: Drive, kinds: torch.Tensor) -> dict[str, float]:
    """The metrics' means, overall and per scenario type (``metric/type``)."""
    out: dict[str, float] = {}
    for name, values in drive_.metrics().items():
        out[name] = values.mean().item()
        for i, kind in enumerate(TYPES):
            mask = kinds == i
            if bool(mask.any()):
                out[f"{name}/{kind}"] = values[mask].mean().item()
    return out


def pictures(drive_: Drive, prompts: Sequence[str], count: int) -> list[Picture]:
    """The first closed loop of each scenario type (up to ``count``) drawn as frames among its
    traffic (the drive's snapshots; the start and the end where it kept none), with the world's
    pass rule as its verdict."""
    from fgrpo.worlds.driving.draw import draw_closed_loop

    chosen, seen = [], set()
    for b, k in enumerate(drive_.start.kind.tolist()):
        if k not in seen:
            seen.add(k)
            chosen.append(b)
    chosen = (chosen + [b for b in range(len(prompts)) if b not in chosen])[:count]
    out = []
    for b in chosen:
        step = int(drive_.collision_step[b])
        frames = drive_.snapshots or {0.0: drive_.start, (drive_.path.shape[1] - 1) * sim.DT: drive_.end}
        image = draw_closed_loop(frames, b, drive_.path[b], step + 1 if step >= 0 else None)
        read = (
            f"CL {drive_.cl_score[b]:.2f}, {drive_.mean_speed[b]:.1f} m/s"
            + (f" ({drive_.speed_excess[b]:.1f} above the limit)" if drive_.speed_excess[b] > 0.05 else "")
            + f", jerk {drive_.jerk[b]:.1f}"
            + (", collision" if drive_.collision[b] else "")
            + (", off road" if drive_.off_road[b] else "")
        )
        score, verdict = float(drive_.cl_score[b]), bool(drive_.passed[b])
        out.append(Picture(prompt=prompts[b], image=image, score=score, read=read, passed=verdict))
    return out


@attrs.define
class ClosedLoop:
    """The driving world's gold metric (``evaluator: driving-closed-loop``): every held-out
    scenario driven by the policy for ``seconds`` among reactive IDM traffic, replanning every
    0.5 s with the evaluation's deterministic sampler; collision, off-road, progress, stuck,
    jerk and CL-score, overall and per scenario type (see the module docstring)."""

    seconds: float = param(12.0, gt=0.0, le=20.0, help="length of each closed loop [s]")
    scenarios: int = param(0, ge=0, help="held-out scenarios driven; 0 = every test prompt")
    pictures: int = param(5, ge=0, help="closed loops drawn for the report (the first of each type first), as frames")
    safety_filter: dict | None = param(None, validator=safety.validate, help=safety.HELP)

    directions = DIRECTIONS
    category_noun = "scenario type"
    limits = LIMITS

    def __call__(self, context: Any) -> EvaluatorResult:
        prompts = list(context.prompts)
        prompts = prompts[: self.scenarios] if self.scenarios else prompts
        start = scene_store.scenes_for(prompts)
        planner, tally = evaluation_planner(context, "cl", self.safety_filter)
        result = drive(planner, start, self.seconds, keep=frame_times(self.seconds, REPLAN) if self.pictures else ())
        metrics = summarize(result, start.kind) | (tally.metrics() if tally is not None else {})
        return EvaluatorResult(metrics=metrics, pictures=pictures(result, prompts, self.pictures))


def reference_scores(prompts: Sequence[str], seconds: float = 12.0) -> dict[str, dict[str, float]]:
    """The closed-loop metrics of the teacher and of constant velocity on ``prompts`` (the
    comparisons the notes quote)."""
    start = scene_store.scenes_for(list(prompts))
    return {
        name: summarize(drive(planner, start, seconds), start.kind)
        for name, planner in (("teacher", teacher_planner), ("constant-velocity", constant_velocity_planner))
    }


@attrs.define
class Rollout:
    """The closed loop as a reward (``driving-rollout``): each plan is executed for its first
    ``execute`` s among reactive traffic (0.5 by default, the closed loop's replanning period), then
    the teacher (or the ``expert``, the teacher without its flaws) drives on by its own control
    until ``seconds``. The score is that loop's CL-score (no collision x on road x progress) x
    exp(-mean speed above the limit / 2 m/s) (x a comfort factor with ``jerk_scale``): the driver's
    cost-to-go after the plan (AggreVaTe's), where the open-loop terms value the whole plan as if it
    were executed to its end among blind traffic. At 0.5 s the driver who takes over makes every
    lane change itself, so no plan has to start one; ``recipes/driving-nft.yaml`` executes 2 s.

    ``speeding`` says over which part the speed above the limit is measured: ``plan`` (the default),
    the executed part, which is all the planner drives, or ``loop``, the whole loop. Over the loop
    the driver who keeps the limit for the other 6 s dilutes the plan's speeding fourfold, while the
    closed loop is made of nothing but executed parts: a planner trained that way drove 1.09 m/s
    above the limit on average (0.16 priced on the plan; docs/planners.md)."""

    category_noun = "scenario type"

    seconds: float = param(8.0, gt=0.5, le=20.0, help="length of each loop [s], the plan's part included")
    execute: float = param(
        REPLAN,
        gt=0.0,
        le=4.0,
        help="how much of the plan is executed before the driver takes over [s]; the closed loop executes 0.5",
    )
    jerk_scale: float = param(0.0, ge=0.0, help="x exp(-(RMS jerk of the loop / jerk_scale)^2 / 2); 0: no factor")
    continuation: str = param(
        "teacher",
        choices=("teacher", "expert"),
        help="who drives after the plan: the flawed teacher of the logs, or the same IDM + MOBIL driver without "
        "its flaws (see sim.EXPERT)",
    )
    speeding: str = param(
        "plan",
        choices=("plan", "loop"),
        help="where the speed above the limit is measured for exp(-excess / 2): the plan's executed part, or the "
        "whole loop (the continuation's driving too)",
    )

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], prefix: str) -> list[ConfigError]:
        if values["execute"] < values["seconds"]:
            return []
        return [
            ConfigError(
                f"{prefix}.execute" if prefix else "execute",
                f"got {values['execute']:g}; allowed: less than seconds ({values['seconds']:g})",
            )
        ]

    def __call__(self, outputs: Any, prompts: Sequence[str], metadata: Sequence[Any]) -> RewardResult:
        plans = check_plans(outputs, len(prompts), f"driving-{self.key}")
        start = scene_store.scenes_for(list(prompts))
        _, executed = sim.execute(start, plans, self.execute)
        planned = len(executed)
        after = executed[-1] if self.continuation == "teacher" else sim.without_flaws(executed[-1])
        executed += sim.teacher_rollout(after, int(round((self.seconds - self.execute) / sim.DT)))
        result = judge(start, executed, self.seconds)
        if self.speeding == "plan":
            excess = judge(start, executed[:planned], self.execute).speed_excess
        else:
            excess = result.speed_excess
        # the loop's CL-score caps progress at the free-road distance but never sees the limit: a
        # plan that speeds for 0.5 s and leaves the braking to the teacher would score as well
        scores = result.cl_score * speeding_factor(excess)
        if self.jerk_scale:
            scores = scores * jerk_factor(result.jerk, self.jerk_scale)
        return RewardResult(
            scores=scores.to(outputs.device),
            details={
                "rollout": scores,
                "cl_score": result.cl_score,
                "speed_excess": excess,
                "collision": result.collision.float(),
                "off_road": result.off_road.float(),
                "progress_ratio": result.progress,
                "jerk_rms": result.jerk,
                "mean_speed": result.mean_speed,
                "passed": passes(result.collision, result.off_road, result.mean_speed, excess, result.jerk),
                "category": [TYPES[int(k)] for k in start.kind],
                "read": [
                    reading(
                        result.mean_speed[b],
                        result.progress[b],
                        result.jerk[b],
                        result.collision_time[b],
                        result.off_road[b],
                    )
                    for b in range(len(prompts))
                ],
            },
        )

    #: the same pictures as the open-loop terms: each group's candidate plans over its scene
    draw = DrivingTerm.draw
    #: its score in ``details``, as the open-loop terms' (the reward is ``driving-<key>``)
    key: ClassVar[str] = "rollout"
