"""A randomised driving world (``prompts.randomize``): the other drivers' behaviour and the traffic's
density drawn per training scenario within ranges a recipe sets, so a planner cannot learn one
population of drivers by heart.

Every key is a range ``[low, high]`` drawn uniformly, per car where it is a car's, per scenario
otherwise; a draw is a pure function of (type, seed) (its own stream of
:func:`~fgrpo.worlds.driving.world.uniforms`), so scenario 7 of ``cut-in`` is the same randomised
scene on every machine, and what was drawn is recorded in the scene itself (the cars' IDM
parameters and scripted lane changes). Held-out scenarios are never randomised: the gold stays
comparable with every earlier run.

- ``desired_speed``: each car's IDM desired speed as a factor of its starting speed (below 1 the
  car slows down ahead of you, above 1 it closes in from behind); a stopped car stays stopped.
- ``headway``, ``min_gap``, ``max_accel``, ``comfort_decel``: the IDM's time headway [s], minimum
  gap [m], maximum acceleration and comfortable deceleration [m/s^2] of every car.
- ``lane_change_rate``: the probability that a car with no scripted lane change of its own changes
  to a neighbouring lane once, at a time drawn over the first 8 s, whatever the gap it leaves
  (highway-env's drivers change lanes by MOBIL with politeness 0: the ego is cut in on);
  ``lane_change_duration``: how long a change takes [s].
- ``cars_per_lane``: extra cars per lane, placed at least :data:`SPACING` m from every car of
  their lane and from the ego, driving 0.5-1.0 x the limit.
- ``fraction`` (a number, not a range; default 1): the share of training scenarios randomised, drawn
  per scenario on a stream of its own; the others keep the generator's drivers (a mixed world).

The drivers here follow scripted lane changes, not MOBIL, so MOBIL's politeness and threshold have
no counterpart but the lane-change rate, and a reaction delay none (docs/planners.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fgrpo.worlds.driving.world import FAR, MAX_AGENTS, TYPES, Scene, lane_centre, nearest_lane, uniforms

#: each key's range of allowed values (a recipe's range must lie inside it)
BOUNDS: dict[str, tuple[float, float]] = {
    "desired_speed": (0.0, 2.0),
    "headway": (0.1, 4.0),
    "min_gap": (0.0, 10.0),
    "max_accel": (0.1, 6.0),
    "comfort_decel": (0.1, 9.0),
    "lane_change_rate": (0.0, 1.0),
    "lane_change_duration": (1.0, 8.0),
    "cars_per_lane": (0.0, 6.0),
}
KEYS = (*BOUNDS, "fraction")
SPACING = 12.0  #: m, centre to centre, between an added car and any car of its lane or the ego
_STREAM = 7919  #: offsets the scenario type in the hash: the randomisation's draws are a stream of their own
_PER_SCENE, _PER_CAR = 2, 8  #: draws per scenario, per car slot


def validate(_instance: Any, _attribute: Any, value: Any) -> None:
    """``prompts.randomize``: null or {key: [low, high]} with keys of :data:`BOUNDS`."""
    if value is None:
        return
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"got {value!r}; allowed: null or a mapping of {', '.join(KEYS)} to [low, high]")
    problems = [f"{k}: unknown key" for k in value if k not in KEYS]
    fraction = value.get("fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        problems.append(f"fraction: got {fraction!r}; allowed: a number from 0 to 1")
    for key, pair in value.items():
        if key not in BOUNDS:
            continue
        lo_bound, hi_bound = BOUNDS[key]
        ok = (
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)
            and lo_bound <= pair[0] <= pair[1] <= hi_bound
        )
        if not ok:
            problems.append(
                f"{key}: got {pair!r}; allowed: [low, high] with {lo_bound:g} <= low <= high <= {hi_bound:g}"
            )
    if problems:
        raise ValueError("; ".join(problems) + f" (keys: {', '.join(KEYS)})")


def _between(u: torch.Tensor, spec: Mapping[str, Any], key: str) -> torch.Tensor:
    low, high = (float(v) for v in spec[key])
    return low + (high - low) * u


def randomize(scene: Scene, spec: Mapping[str, Any]) -> Scene:
    """The t0 scenes ``scene`` with the drivers and density drawn by ``spec`` (see the module
    docstring); keys left out keep the scene's own values."""
    b, n = len(scene), MAX_AGENTS
    u = uniforms(scene.kind + _STREAM + len(TYPES), scene.seed, _PER_SCENE + n * _PER_CAR).float()
    per_scene, per_car = u[:, :_PER_SCENE], u[:, _PER_SCENE:].reshape(b, n, _PER_CAR)
    agents, valid, idm, lane_change = (
        scene.agents.clone(),
        scene.valid.clone(),
        scene.idm.clone(),
        scene.lane_change.clone(),
    )
    if "cars_per_lane" in spec:
        agents, valid, idm, lane_change = _add_cars(
            scene, per_scene[:, 0], per_car, spec, agents, valid, idm, lane_change
        )
    speed = agents[..., 3]
    moving = idm[..., 0] > 0
    if "desired_speed" in spec:
        idm[..., 0] = torch.where(moving, speed * _between(per_car[..., 0], spec, "desired_speed"), idm[..., 0])
    for column, key in enumerate(("headway", "min_gap", "max_accel", "comfort_decel"), start=1):
        if key in spec:
            idm[..., column] = _between(per_car[..., column], spec, key)
    if "lane_change_rate" in spec:
        lane_change = _lane_changes(scene, per_scene[:, 1], per_car, spec, agents, valid, lane_change)
    drawn = uniforms(scene.kind + 2 * (_STREAM + len(TYPES)), scene.seed, 1)[:, 0] < float(spec.get("fraction", 1.0))

    def kept(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return torch.where(drawn.view(-1, *([1] * (new.dim() - 1))), new, old)

    return scene.replace(
        agents=kept(agents, scene.agents),
        valid=kept(valid, scene.valid),
        idm=kept(idm, scene.idm),
        lane_change=kept(lane_change, scene.lane_change),
    )


def _lane_changes(
    scene: Scene,
    rate_u: torch.Tensor,
    per_car: torch.Tensor,
    spec: Mapping[str, Any],
    agents: torch.Tensor,
    valid: torch.Tensor,
    lane_change: torch.Tensor,
) -> torch.Tensor:
    lanes, width = scene.lanes[:, None], scene.lane_width[:, None]
    lane = nearest_lane(agents[..., 1], lanes, width)
    left = per_car[..., 6] < 0.5
    target = torch.where(left, lane + 1, lane - 1)
    target = torch.where((target < 0) | (target >= lanes), 2 * lane - target, target)
    free = lane_change[..., 3] <= 0  # a car already scripted to change keeps its change
    rate = _between(rate_u, spec, "lane_change_rate")
    changes = valid & free & (per_car[..., 5] < rate[:, None])
    changes &= target != lane
    duration_u = per_car[..., 7]
    duration = (
        _between(duration_u, spec, "lane_change_duration")
        if "lane_change_duration" in spec
        else 2.0 + 2.0 * duration_u
    )
    out = lane_change.clone()
    out[..., 1] = torch.where(changes, lane_centre(target, width), out[..., 1])
    out[..., 2] = torch.where(changes, 8.0 * per_car[..., 4], out[..., 2])
    out[..., 3] = torch.where(changes, duration, out[..., 3])
    return out


def _add_cars(
    scene: Scene,
    count_u: torch.Tensor,
    per_car: torch.Tensor,
    spec: Mapping[str, Any],
    agents: torch.Tensor,
    valid: torch.Tensor,
    idm: torch.Tensor,
    lane_change: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill free car slots, in slot order, with cars drawn per lane until each scene has its drawn
    count (``cars_per_lane`` x lanes) or no slot is left; a car too close to another is left out."""
    b, n = valid.shape
    lanes, width, limit = scene.lanes, scene.lane_width, scene.speed_limit
    count = torch.floor(_between(count_u, spec, "cars_per_lane") * lanes)
    added = torch.zeros(b)
    for i in range(n):
        slot_free = ~valid[:, i] & (added < count)
        lane = torch.floor(per_car[:, i, 1] * lanes)
        x = -70.0 + 220.0 * per_car[:, i, 2]
        y = lane_centre(lane, width)
        same_lane = valid & ((agents[..., 1] - y[:, None]).abs() < 0.5 * width[:, None])
        clash = (same_lane & ((agents[..., 0] - x[:, None]).abs() < SPACING)).any(1)
        clash |= ((scene.ego[:, 1] - y).abs() < 0.5 * width) & ((scene.ego[:, 0] - x).abs() < SPACING)
        put = slot_free & ~clash
        v = limit * (0.5 + 0.5 * per_car[:, i, 3])
        agents[:, i] = torch.where(put[:, None], torch.stack([x, y, torch.zeros_like(x), v], 1), agents[:, i])
        # the generator's own drivers: cruising at their speed, 1.5 s headway, 2 m gap
        defaults = torch.stack([v, *(torch.full_like(v, c) for c in (1.5, 2.0, 1.5, 2.0))], 1)
        idm[:, i] = torch.where(put[:, None], defaults, idm[:, i])
        lane_change[:, i] = torch.where(
            put[:, None], torch.stack([y, y, torch.zeros_like(y), torch.zeros_like(y)], 1), lane_change[:, i]
        )
        valid[:, i] |= put
        added += put.float()
    agents[..., 0] = torch.where(valid, agents[..., 0], torch.full_like(agents[..., 0], FAR))
    return agents, valid, idm, lane_change
