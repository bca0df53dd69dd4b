"""The safety filter between a planner and the car (the second source text's "closed-loop simulation
→ safety filter → shadow mode"): at each replanning it checks candidate plans in a short
simulation of predicted traffic and lets through only those that keep clear, braking when none does.

At a replanning the filter receives, per scene, the planner's plan first and then the other
candidates (more draws of the policy, the behaviour-cloning base's plan). Each is executed by the
tracking controller for ``horizon`` s against two predictions of the other cars: IDM along their
lanes, as our world drives them without seeing the ego (:func:`~fgrpo.worlds.driving.sim.agent_paths`),
and constant velocity along their heading. A candidate is **kept** when under both predictions
the ego causes no collision (a car behind that runs into a braking ego does not count, as in the
open-loop rewards), keeps every corner on the road and, with ``min_ttc`` > 0, keeps its time to
collision above it. Of the kept candidates it executes the planner's own plan when that is kept
(``select: first``, the least intervention) or the best by ``score`` = progress over the horizon
(as a share of the free-road distance) x min(1, smallest TTC / ``ttc_scale``) (``select: best``).
When nothing is kept it brakes at ``brake`` m/s^2 in its lane.

:class:`Interventions` counts, over every replanning, how often the planner's plan was replaced,
why (a predicted collision, a departure, a TTC under ``min_ttc``) and how often the filter braked.
:func:`filtered_planner` wraps any :data:`~fgrpo.worlds.driving.closed_loop.Planner` source, so
the closed-loop evaluators, ``driving-highway`` and deployment code share one filter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

import fgrpo.worlds.driving.sim as sim
from fgrpo.core.config import param
from fgrpo.worlds.driving.rewards import measure
from fgrpo.worlds.driving.world import HORIZON_STEPS, PLAN_DT, Scene

#: candidates (scenes, replanning round) -> (B, K, T, 2) plans, the planner's own plan first
Candidates = Callable[[Scene, int], torch.Tensor]
SELECT = ("first", "best")
HELP = (
    "check each replanning's plan in a short simulation of predicted traffic and execute a candidate that keeps "
    "clear, braking when none does: {candidates, base, horizon, min_ttc, select, ttc_scale, brake} "
    "(fgrpo.worlds.driving.safety); null: the policy's plan as it is"
)


def constant_velocity_paths(scene: Scene, steps: int) -> torch.Tensor:
    """(B, steps + 1, N, 4) the other cars going on at their speed along their heading."""
    x, y, heading, v = scene.agents.unbind(-1)
    t = torch.arange(steps + 1, dtype=x.dtype) * sim.DT
    moved_x = x[:, None] + (v * torch.cos(heading))[:, None] * t[None, :, None]
    moved_y = y[:, None] + (v * torch.sin(heading))[:, None] * t[None, :, None]
    moved_x = torch.where(scene.valid[:, None], moved_x, x[:, None].expand_as(moved_x))
    moved_y = torch.where(scene.valid[:, None], moved_y, y[:, None].expand_as(moved_y))
    return torch.stack([moved_x, moved_y, heading[:, None].expand_as(moved_x), v[:, None].expand_as(moved_x)], -1)


def braking_plan(scene: Scene, deceleration: float) -> torch.Tensor:
    """(B, T, 2) stopping at ``deceleration`` m/s^2 straight ahead in the ego frame (its lane)."""
    v = scene.ego[:, 3:4].clamp_min(0.0)
    t = torch.arange(1, HORIZON_STEPS + 1, dtype=v.dtype)[None] * PLAN_DT
    stop = v / deceleration
    moving = torch.minimum(t, stop)
    x = v * moving - 0.5 * deceleration * moving.pow(2)
    return torch.stack([x, torch.zeros_like(x)], -1)


@attrs.frozen
class Check:
    """What the filter measured of (B, K) candidates: kept or not, and why not, and their score."""

    kept: torch.Tensor
    collision: torch.Tensor
    off_road: torch.Tensor
    close: torch.Tensor  # TTC under min_ttc
    score: torch.Tensor


@attrs.define
class Interventions:
    """Counts over every replanning a filter made (each scene at each round is one)."""

    replannings: int = 0
    replaced: int = 0
    braked: int = 0
    collision: int = 0  # the planner's own plan predicted to collide
    off_road: int = 0
    close: int = 0

    def add(self, check: Check, chosen: torch.Tensor, braked: torch.Tensor) -> None:
        own_rejected = ~check.kept[:, 0]
        self.replannings += len(chosen)
        self.replaced += int(((chosen != 0) | braked).sum())
        self.braked += int(braked.sum())
        self.collision += int((own_rejected & check.collision[:, 0]).sum())
        self.off_road += int((own_rejected & check.off_road[:, 0]).sum())
        self.close += int((own_rejected & check.close[:, 0]).sum())

    def metrics(self) -> dict[str, float]:
        """Shares of the replannings: ``filter/intervened`` (the planner's plan replaced),
        ``filter/braked`` and, for the planner's own plan, each reason it was rejected."""
        n = max(1, self.replannings)
        return {
            "filter/intervened": self.replaced / n,
            "filter/braked": self.braked / n,
            "filter/predicted_collision": self.collision / n,
            "filter/predicted_off_road": self.off_road / n,
            "filter/predicted_close": self.close / n,
        }


@attrs.frozen
class SafetyFilter:
    """The filter's settings (see the module docstring); a recipe gives them as an evaluator's
    ``safety_filter`` mapping (:func:`build`)."""

    candidates: int = param(8, ge=1, le=64, help="plans drawn from the policy per replanning (its own plan first)")
    base: bool = param(True, help="add the behaviour-cloning base's plan as one more candidate")
    horizon: float = param(3.0, gt=0.0, le=8.0, help="seconds of predicted traffic each candidate is checked over")
    min_ttc: float = param(
        0.0, ge=0.0, le=10.0, help="reject a candidate whose time to collision falls under this [s]"
    )
    select: str = param("first", choices=SELECT, help="first: the planner's plan when kept; best: the best kept")
    ttc_scale: float = param(2.0, gt=0.0, le=10.0, help="TTC [s] above which a candidate's score is its progress")
    brake: float = param(6.0, gt=0.0, le=8.0, help="deceleration of the fallback plan [m/s^2]")

    def check(self, scene: Scene, plans: torch.Tensor) -> Check:
        """Measure (B, K, T, 2) candidates from ``scene`` against both predictions."""
        b, k = plans.shape[:2]
        steps = int(round(self.horizon / sim.DT))
        rows = torch.arange(b).repeat_interleave(k)
        scenes = scene.index(rows)
        flat = plans.reshape(b * k, *plans.shape[2:])
        outcomes = [
            measure(flat, scenes, self.horizon, paths[rows])
            for paths in (sim.agent_paths(scene, steps), constant_velocity_paths(scene, steps))
        ]
        collision = (outcomes[0].collision | outcomes[1].collision).reshape(b, k)
        off = (outcomes[0].off_road | outcomes[1].off_road).reshape(b, k)
        ttc = torch.minimum(outcomes[0].min_ttc, outcomes[1].min_ttc).reshape(b, k)
        close = ttc < self.min_ttc if self.min_ttc > 0 else torch.zeros_like(collision)
        progress = torch.minimum(outcomes[0].progress_ratio, outcomes[1].progress_ratio).reshape(b, k)
        score = progress * (ttc / self.ttc_scale).clamp(max=1.0)
        return Check(kept=~(collision | off | close), collision=collision, off_road=off, close=close, score=score)

    def choose(self, scene: Scene, plans: torch.Tensor, tally: Interventions | None = None) -> torch.Tensor:
        """(B, T, 2): per scene the candidate to execute (or the braking plan)."""
        check = self.check(scene, plans)
        if self.select == "first":
            order = torch.arange(plans.shape[1], 0, -1, dtype=torch.float32).expand_as(check.score)
        else:
            order = check.score
        ranked = torch.where(check.kept, order, torch.full_like(order, -1.0))
        chosen = ranked.argmax(1)
        braked = ~check.kept.any(1)
        picked = plans[torch.arange(len(plans)), chosen]
        out = torch.where(braked[:, None, None], braking_plan(scene, self.brake), picked)
        if tally is not None:
            tally.add(check, chosen, braked)
        return out


def filtered_planner(candidates: Candidates, safety: SafetyFilter, tally: Interventions) -> Callable[..., Any]:
    """A planner that asks ``candidates`` for (B, K, T, 2) plans and executes what ``safety`` keeps."""

    def plan(scene: Scene, round_: int) -> torch.Tensor:
        plans = candidates(scene, round_)[..., :2]
        return safety.choose(scene, plans, tally)

    return plan


def build(value: Any) -> SafetyFilter | None:
    """The filter an evaluator's ``safety_filter`` value sets (None: off); raises ValueError("got
    ...; allowed ...") naming the sub-key, as a recipe key's validator does."""
    if value is None:
        return None
    names = [a.name for a in attrs.fields(SafetyFilter)]
    if not isinstance(value, Mapping):
        raise ValueError(f"got {value!r}; allowed: null (off) or a mapping with keys {', '.join(names)}")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"got unknown key(s) {', '.join(map(repr, unknown))}; allowed keys: {', '.join(names)}")
    for field in attrs.fields(SafetyFilter):
        if field.name in value and not _of_type(value[field.name], field.default):
            raise ValueError(f"got {field.name} {value[field.name]!r}; allowed: {_type_words(field.default)}")
    for name, given in value.items():  # one key at a time, so the message names the bad one
        try:
            SafetyFilter(**{name: given})
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return SafetyFilter(**value)


def validate(_instance: Any, _attribute: Any, value: Any) -> None:
    """An evaluator key's validator (``safety_filter: dict | None = param(None, validator=validate)``)."""
    build(value)


def _of_type(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(default, str):
        return isinstance(value, type(default))
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_words(default: Any) -> str:
    return {bool: "true or false", str: "a string", int: "an integer"}.get(type(default), "a number")
