"""The driving world's rewards: each term its own registered reward, so recipes weight them.

Every term scores plans (B, T, 2) — waypoints at 0.5 s, 1.0 s, ... in the ego frame — for the
scenes their prompts name (:mod:`.scenes`), from one **non-reactive simulation** shared by all
terms of a batch: the tracking controller executes the plan on the kinematic bicycle for
``horizon`` seconds (default 4) while the other cars drive as if the ego were not there (IDM
among themselves, scripted lane changes), as NAVSIM's PDM score does.

Terms (all in [0, 1], higher is better; ``details`` carry the raw measurements per sample):

- ``driving-safety``: no at-fault collision x min(1, min TTC / ``ttc_threshold``);
- ``driving-drivable``: 0 if a corner of the ego leaves the road, else min(1, the smallest margin
  to the road's edges / ``margin``);
- ``driving-rules``: lane keeping exp(-max(0, time straddling a lane line - ``allowed_straddle``))
  x speed limit exp(-mean excess speed / 2 m/s);
- ``driving-comfort``: exp(-(RMS jerk / ``jerk_scale``)^2 / 2) x exp(-max(0, peak lateral
  acceleration - 3 m/s^2) / 2);
- ``driving-progress``: distance along the road / the free-road distance (accelerating at
  1.5 m/s^2 up to the speed limit), clipped to [0, 1];
- ``driving-imitation``: exp(-ADE / ``scale``), ADE the mean distance to the teacher's plan
  from the same scene (the image-KL analogue of the seed: stay near the expert);
- ``driving-consistency``: exp(-mean distance / ``scale``) between the plan and the plan made
  0.5 s before this scene (the same times), 1 where there was none;
- ``driving-pdms``: NAVSIM's PDM score NC x DAC x (5 TTC + 5 EP + 2 C) / 12 with binary no
  collision NC, drivable DAC, TTC >= ``ttc_threshold``, comfort C (NAVSIM's thresholds: |lon.
  jerk| <= 4.13 m/s^3, |lat. accel| <= 4.89 m/s^2, lon. accel in [-4.05, 2.40] m/s^2) and the
  progress ratio EP;
- ``driving-carl``: CaRL's multiplicative form, progress x every other term (no collision, TTC,
  drivable, rules, comfort): one infraction costs its share of all the progress.

``details["category"]`` is the scenario type, so held-out metrics come per type.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch

import fgrpo.worlds.driving.scenes as scene_store
import fgrpo.worlds.driving.sim as sim
from fgrpo.core.config import param
from fgrpo.core.protocols import RewardResult
from fgrpo.worlds.driving.world import HORIZON_STEPS, PLAN_DT, TYPES, Scene

LON_JERK_MAX, LAT_ACCEL_MAX, LON_ACCEL_RANGE = 4.13, 4.89, (-4.05, 2.40)  # NAVSIM's comfort thresholds

#: the farthest a waypoint may lie from the ego [m]. A scene starts no car faster than MAX_SPEED
#: (60 m/s) and the ego accelerates at most 4 m/s^2, so a 4 s plan reaches 272 m from a scene's
#: start, 600 m after a whole 20 s loop at full throttle: farther waypoints come from a broken
#: policy, and from about 1e19 m on the simulation's float32 squares overflow to inf and the scores
#: to NaN. Below 1 km the tracker chases an unreachable plan and the terms score what it drove.
MAX_WAYPOINT = 1000.0
#: which plans a refusal names (then "...")
NAMED_PLANS = 3


def check_plans(outputs: Any, n: int, name: str = "driving") -> torch.Tensor:
    """``outputs`` as (n, T, 2) float32 plans on the CPU; ValueError (one line, starting with the
    reward's ``name``) for anything else: a wrong shape, NaN or infinite waypoints, waypoints
    farther than :data:`MAX_WAYPOINT` from the ego. A policy that plans those has diverged, and
    scoring them 0 would train on its garbage: the run stops, saying which plans and what to do."""
    if (
        not isinstance(outputs, torch.Tensor)
        or outputs.dim() != 3
        or outputs.shape[2] not in (2, 3)
        or outputs.shape[0] != n
    ):
        shape = tuple(outputs.shape) if hasattr(outputs, "shape") else type(outputs).__name__
        raise ValueError(f"{name}: plans are ({n}, T, 2) waypoints (x forward, y left, metres), got {shape}")
    plans = outputs.detach().cpu()[..., :2].double()  # float32 would turn 1e39 into inf
    broken = (~torch.isfinite(plans)).flatten(1).any(1)
    far = (plans.nan_to_num(0.0, 0.0, 0.0).abs() > MAX_WAYPOINT).flatten(1).any(1)
    bad = (broken | far).nonzero().flatten().tolist()
    if bad:
        named = ", ".join(map(str, bad[:NAMED_PLANS])) + (", ..." if len(bad) > NAMED_PLANS else "")
        if not far.any():
            what = "NaN or infinite waypoints"
        elif not broken.any():
            what = f"waypoints up to {plans[far].abs().max().item():.3g} m"
        else:
            what = "NaN, infinite or far waypoints"
        several = len(bad) > 1
        raise ValueError(
            f"{name}: plan{'s' if several else ''} {named} ({len(bad)} of {n}) {'have' if several else 'has'} {what}; "
            f"allowed: finite, |x|, |y| <= {MAX_WAYPOINT:g} m (a diverged policy: resume from a checkpoint, lower "
            "train.lr)"
        )
    plans = plans.float()
    if plans.shape[1] != HORIZON_STEPS:
        raise ValueError(f"{name}: plans have {HORIZON_STEPS} waypoints at {PLAN_DT} s, got {plans.shape[1]}")
    return plans


@attrs.frozen
class Outcome:
    """What the non-reactive simulation of a batch of plans measured (every field (B,))."""

    collision: torch.Tensor  # bool, at fault
    collision_time: torch.Tensor  # s after the plan was made; inf without collision
    off_road: torch.Tensor  # bool
    edge_margin: torch.Tensor  # m: the smallest distance of a corner to the road's edges (negative: off)
    min_ttc: torch.Tensor  # s
    progress: torch.Tensor  # m along the road
    progress_ratio: torch.Tensor  # progress / the free-road distance, clipped to [0, 1]
    jerk_rms: torch.Tensor  # m/s^3, of the executed longitudinal acceleration
    jerk_max: torch.Tensor
    lat_accel_max: torch.Tensor  # m/s^2
    lon_accel_min: torch.Tensor
    lon_accel_max: torch.Tensor
    speed_excess: torch.Tensor  # m/s above the limit, averaged over the steps
    straddle_time: torch.Tensor  # s with the centre more than 0.8 m off every lane centre
    mean_speed: torch.Tensor
    scenes: Scene
    executed: torch.Tensor  # (B, S+1, 5) the ego's states


STUCK_SPEED = 2.0  #: m/s: a mean speed under it is stuck
SPEED_MARGIN = 1.0  #: m/s above the limit on average that a passing drive may keep
#: m/s^3: nuPlan's comfort bound on the ego's jerk (nuplan-devkit ego_jerk, max_abs_mag_jerk 8.37),
#: here on its RMS over the drive, which a drive within nuPlan's bound keeps a fortiori
JERK_BOUND = 8.37
PASS_RULE = (
    f"no collision, on the road, not stuck (mean speed {STUCK_SPEED:g} m/s or more), at most {SPEED_MARGIN:g} m/s "
    f"above the limit on average, RMS jerk at most {JERK_BOUND:g} m/s^3"
)


def passes(
    collision: torch.Tensor, off_road: torch.Tensor, speed: torch.Tensor, excess: torch.Tensor, jerk: torch.Tensor
) -> torch.Tensor:
    """The driving world's pass rule (:data:`PASS_RULE`) per drive or plan: the verdict on a
    picture's badge, so a CL-score of 1 at 35 m/s on a 25 m/s road fails."""
    safe = ~collision.bool() & ~off_road.bool() & (speed >= STUCK_SPEED)
    return safe & (excess <= SPEED_MARGIN) & (jerk <= JERK_BOUND)


def free_distance(v0: torch.Tensor, limit: torch.Tensor, seconds: float, accel: float = 1.5) -> torch.Tensor:
    """Metres covered in ``seconds`` from speed v0 accelerating at ``accel`` up to ``limit`` (or
    holding v0 when it is at or above the limit)."""
    cap = torch.maximum(v0, limit)
    reach = ((cap - v0) / accel).clamp(0, seconds)
    return v0 * reach + 0.5 * accel * reach**2 + cap * (seconds - reach)


def measure(
    plans: torch.Tensor,
    scenes: Scene,
    horizon: float,
    agents: torch.Tensor | None = None,
    *,
    reactive: bool = False,
) -> Outcome:
    """Simulate ``plans`` from ``scenes`` for ``horizon`` s (non-reactive, ``agents`` the other
    cars' precomputed paths; or among ``reactive`` traffic) and measure it all."""
    run = sim.simulate_plan(scenes, plans, horizon, agents=agents, reactive=reactive)
    ego = run["ego"]
    hit = run["collision"]
    first = torch.where(hit.any(1), (hit.float().argmax(1) + 1) * sim.DT, torch.full((len(scenes),), math.inf))
    accel = ego[..., 4]
    accel_seq = torch.cat([scenes.ego[:, None, 4], accel[:, 1:]], 1)
    jerk = (accel_seq[:, 1:] - accel_seq[:, :-1]) / sim.DT
    v = ego[..., 3]
    yaw_rate = (ego[:, 1:, 2] - ego[:, :-1, 2]) / sim.DT
    lat = (0.5 * (v[:, 1:] + v[:, :-1]) * yaw_rate).abs()
    corners = sim.ego_corners(ego[:, 1:])[..., 1]  # (B, S, 4) lateral positions
    top = (scenes.lanes * scenes.lane_width)[:, None, None]
    margin = torch.minimum(corners, top - corners).amin((1, 2))
    width = scenes.lane_width[:, None]
    offset = torch.remainder(ego[:, 1:, 1], width) - width / 2
    straddle = (offset.abs() > 0.8).float().sum(1) * sim.DT
    limit = scenes.speed_limit
    progress = ego[:, -1, 0] - ego[:, 0, 0]
    ratio = (progress / free_distance(scenes.ego[:, 3], limit, horizon).clamp_min(1.0)).clamp(0.0, 1.0)
    return Outcome(
        collision=hit.any(1),
        collision_time=first,
        off_road=run["off_road"].any(1),
        edge_margin=margin,
        min_ttc=run["ttc"].amin(1),
        progress=progress,
        progress_ratio=ratio,
        jerk_rms=jerk.pow(2).mean(1).sqrt(),
        jerk_max=jerk.abs().amax(1),
        lat_accel_max=lat.amax(1),
        lon_accel_min=accel[:, 1:].amin(1),
        lon_accel_max=accel[:, 1:].amax(1),
        speed_excess=speed_excess(v[:, 1:], limit),
        straddle_time=straddle,
        mean_speed=v[:, 1:].mean(1),
        scenes=scenes,
        executed=ego,
    )


_CACHE: OrderedDict[tuple, Outcome] = OrderedDict()


def outcome(plans: torch.Tensor, prompts: Sequence[str], horizon: float, reactive: bool = False) -> Outcome:
    """:func:`measure` of a batch, kept for the other terms of the same batch (the last 8 batches)."""
    key = (hash(plans.numpy().tobytes()), tuple(prompts), horizon, reactive)
    if key not in _CACHE:
        _CACHE[key] = _measure_batch(plans, prompts, horizon, reactive)
    while len(_CACHE) > 8:
        _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    return _CACHE[key]


def _measure_batch(plans: torch.Tensor, prompts: Sequence[str], horizon: float, reactive: bool) -> Outcome:
    if reactive:
        return measure(plans, scene_store.scenes_for(list(prompts)), horizon, reactive=True)
    # the G plans of a group share a scene: the other cars' paths are simulated once per scene
    unique = list(dict.fromkeys(prompts))
    where = (
        torch.tensor([unique.index(p) for p in prompts]) if len(unique) < len(prompts) else torch.arange(len(prompts))
    )
    scenes = scene_store.scenes_for(unique)
    agents = sim.agent_paths(scenes, int(round(horizon / sim.DT)))
    return measure(plans, scenes.index(where), horizon, agents[where])


# --- the terms -------------------------------------------------------------------------------------


def _horizon() -> Any:
    return param(4.0, gt=0.0, le=8.0, help="seconds of the plan the non-reactive simulation executes")


def _reactive() -> Any:
    return param(
        False,
        help="simulate the plan among reactive traffic (the others brake for the ego, every collision counts, "
        "as in the closed loop) instead of NAVSIM's non-reactive simulation",
    )


def _ttc_threshold() -> Any:
    return param(1.5, gt=0.0, help="time to collision [s] at or above which the TTC term is 1")


class DrivingTerm:
    """What every term shares: the checks, the shared simulation, the details and the pictures."""

    __slots__ = ()
    horizon: float
    reactive: bool
    #: the term's name in ``details`` (also the reward's score); the reward is ``driving-<key>``
    key: ClassVar[str] = "score"
    category_noun: ClassVar[str] = "scenario type"

    def score(self, o: Outcome, plans: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, outputs: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardResult:
        plans = check_plans(outputs, len(prompts), f"driving-{self.key}")
        o = outcome(plans, prompts, self.horizon, self.reactive)
        scores = self.score(o, plans, prompts).float()
        device = outputs.device
        return RewardResult(
            scores=scores.to(device),
            details={
                self.key: scores,
                "collision": o.collision.float(),
                "off_road": o.off_road.float(),
                "progress_ratio": o.progress_ratio,
                "jerk_rms": o.jerk_rms,
                "mean_speed": o.mean_speed,
                "speed_excess": o.speed_excess,
                "passed": passes(o.collision, o.off_road, o.mean_speed, o.speed_excess, o.jerk_rms),
                "category": [TYPES[int(k)] for k in o.scenes.kind],
                "read": [_reading(o, b) for b in range(len(prompts))],
            },
        )

    def draw(
        self, outputs: Any, prompts: Sequence[str], metadata: Sequence[Any], scores: torch.Tensor, per_prompt: int
    ) -> torch.Tensor:
        """Top-down pictures for sample grids and the report: every sample shows its scene and
        its group's candidate plans coloured by their scores, its own drawn thick."""
        from fgrpo.worlds.driving.draw import draw_groups

        plans = check_plans(outputs, len(prompts), f"driving-{self.key}")
        return draw_groups(scene_store.scenes_for(list(prompts)), plans, scores.float().cpu(), per_prompt)


def _reading(o: Outcome, b: int) -> str:
    return reading(o.mean_speed[b], o.progress_ratio[b], o.jerk_rms[b], o.collision_time[b], o.off_road[b])


def reading(speed: Any, progress: Any, jerk: Any, collision_time: Any, off: Any) -> str:
    """One sample's line for the grids: speed, progress, jerk, and a collision (inf: none) or off road."""
    what = f"{speed:.1f} m/s, progress {progress:.2f}, jerk {jerk:.1f}"
    if math.isfinite(collision_time):
        what += f", collision at {collision_time:.1f} s"
    if off:
        what += ", off road"
    return what


def ttc_score(o: Outcome, threshold: float) -> torch.Tensor:
    return (o.min_ttc / threshold).clamp(0.0, 1.0)


def drivable_score(o: Outcome, margin: float) -> torch.Tensor:
    return torch.where(o.off_road, torch.zeros_like(o.edge_margin), (o.edge_margin / margin).clamp(0.0, 1.0))


def speed_excess(speeds: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """(B,) mean m/s above each scene's ``limit`` (B,) over the steps of ``speeds`` (B, S)."""
    return (speeds - limit[:, None]).clamp_min(0).mean(1)


def speeding_factor(excess: torch.Tensor) -> torch.Tensor:
    """exp(-mean excess / 2 m/s): what speeding costs the rules term and the rollout alike."""
    return torch.exp(-excess / 2.0)


def jerk_factor(jerk: torch.Tensor, scale: float) -> torch.Tensor:
    """exp(-(RMS jerk / scale)^2 / 2): the comfort term's and the rollout's price of jerk."""
    return torch.exp(-0.5 * (jerk / scale) ** 2)


def rules_score(o: Outcome, allowed: float) -> torch.Tensor:
    return torch.exp(-(o.straddle_time - allowed).clamp_min(0.0)) * speeding_factor(o.speed_excess)


def comfort_score(o: Outcome, jerk_scale: float) -> torch.Tensor:
    return jerk_factor(o.jerk_rms, jerk_scale) * torch.exp(-(o.lat_accel_max - 3.0).clamp_min(0.0) / 2.0)


def comfortable(o: Outcome) -> torch.Tensor:
    """NAVSIM's binary comfort: every threshold held over the horizon."""
    return (
        (o.jerk_max <= LON_JERK_MAX)
        & (o.lat_accel_max <= LAT_ACCEL_MAX)
        & (o.lon_accel_min >= LON_ACCEL_RANGE[0])
        & (o.lon_accel_max <= LON_ACCEL_RANGE[1])
    )


@attrs.define
class Safety(DrivingTerm):
    """No at-fault collision x min(1, min TTC / ttc_threshold) over the simulated plan."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    ttc_threshold: float = _ttc_threshold()
    key: ClassVar[str] = "safety"

    def score(self, o, plans, prompts):
        return (~o.collision).float() * ttc_score(o, self.ttc_threshold)


@attrs.define
class Drivable(DrivingTerm):
    """0 off the road, else min(1, the smallest margin to the road's edges / margin)."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    margin: float = param(0.3, gt=0.0, help="metres of margin to the road's edge that score 1")
    key: ClassVar[str] = "drivable"

    def score(self, o, plans, prompts):
        return drivable_score(o, self.margin)


@attrs.define
class Rules(DrivingTerm):
    """Lane keeping (time on a lane line beyond allowed_straddle) x the speed limit."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    allowed_straddle: float = param(2.0, ge=0.0, help="seconds on a lane line that cost nothing (a lane change)")
    key: ClassVar[str] = "rules"

    def score(self, o, plans, prompts):
        return rules_score(o, self.allowed_straddle)


@attrs.define
class Comfort(DrivingTerm):
    """exp(-(RMS jerk / jerk_scale)^2 / 2) x exp(-max(0, peak lateral acceleration - 3) / 2)."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    jerk_scale: float = param(4.0, gt=0.0, help="RMS jerk [m/s^3] at which the jerk factor is exp(-1/2)")
    key: ClassVar[str] = "comfort"

    def score(self, o, plans, prompts):
        return comfort_score(o, self.jerk_scale)


@attrs.define
class Progress(DrivingTerm):
    """Distance along the road / the free-road distance, in [0, 1]."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    key: ClassVar[str] = "progress"

    def score(self, o, plans, prompts):
        return o.progress_ratio


@attrs.define
class Imitation(DrivingTerm):
    """exp(-ADE / scale): ADE the mean waypoint distance to the teacher's plan from the same scene."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    scale: float = param(2.0, gt=0.0, help="ADE [m] at which the score is exp(-1)")
    key: ClassVar[str] = "imitation"

    def score(self, o, plans, prompts):
        teacher = scene_store.teacher_plans(list(prompts), o.scenes)
        return torch.exp(-(plans - teacher).norm(dim=-1).mean(1) / self.scale)


@attrs.define
class Consistency(DrivingTerm):
    """exp(-mean distance / scale) between this plan and the plan made 0.5 s before its scene, at
    the times both cover (1 where there was no earlier plan)."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    scale: float = param(1.0, gt=0.0, help="mean distance [m] at which the score is exp(-1)")
    key: ClassVar[str] = "consistency"

    def score(self, o, plans, prompts):
        return consistency_score(plans, o.scenes, self.scale)


def consistency_score(plans: torch.Tensor, scenes: Scene, scale: float) -> torch.Tensor:
    previous = scenes.previous_plan  # world frame, waypoints at t, t + 0.5, ... (made at t - 0.5)
    mine = sim.plan_to_world(plans, scenes.ego)[:, : HORIZON_STEPS - 1]  # t + 0.5 ... t + 3.5
    distance = (mine - previous[:, 1:]).norm(dim=-1).mean(1)
    return torch.where(torch.isfinite(distance), torch.exp(-distance / scale), torch.ones_like(distance))


@attrs.define
class PDMS(DrivingTerm):
    """NAVSIM's PDM score: NC x DAC x (5 TTC + 5 EP + 2 C) / 12, NC, DAC, TTC and C binary."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    ttc_threshold: float = param(1.0, gt=0.0, help="TTC [s] at or above which the TTC subscore is 1")
    key: ClassVar[str] = "pdms"

    def score(self, o, plans, prompts):
        nc = (~o.collision).float()
        dac = (~o.off_road).float()
        ttc = (o.min_ttc >= self.ttc_threshold).float()
        return nc * dac * (5 * ttc + 5 * o.progress_ratio + 2 * comfortable(o).float()) / 12


@attrs.define
class CaRL(DrivingTerm):
    """CaRL's multiplicative reward: progress x no collision x TTC x drivable x rules x comfort."""

    horizon: float = _horizon()
    reactive: bool = _reactive()
    ttc_threshold: float = _ttc_threshold()
    margin: float = param(0.3, gt=0.0, help="as for driving-drivable")
    allowed_straddle: float = param(2.0, ge=0.0, help="as for driving-rules")
    jerk_scale: float = param(4.0, gt=0.0, help="as for driving-comfort")
    key: ClassVar[str] = "carl"

    def score(self, o, plans, prompts):
        return (
            o.progress_ratio
            * (~o.collision).float()
            * ttc_score(o, self.ttc_threshold)
            * drivable_score(o, self.margin)
            * rules_score(o, self.allowed_straddle)
            * comfort_score(o, self.jerk_scale)
        )
