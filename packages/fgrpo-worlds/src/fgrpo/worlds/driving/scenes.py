"""Prompts name scenes: what the policy conditions on and what the rewards simulate from.

A prompt is ``"<type> <seed> t<seconds>"``, e.g. ``"cut-in 42 t2.5"``: scenario ``seed`` of that
type, at ``t`` seconds into the teacher's log of it (the teacher driving it from t = 0 among
reactive traffic; ``t`` a multiple of 0.5, ``"cut-in 42"`` means t0). Such a scene is a pure
function of its prompt: logs are computed on first use, a batch of scenarios at a time, and kept.

A prompt may also name a scene that was *registered* under it (:func:`register`): the starting
states taken from the policy's own closed loop (``"cut-in 42 t2.5 self"``, see
:class:`fgrpo.worlds.driving.prompts.DrivingPrompts`) and the live states of the closed-loop
evaluator. A registered scene is looked up by its exact prompt.

:func:`scenes_for` gives the batched :class:`Scene` of any list of prompts; :func:`teacher_plans`
the teacher's plan from each (the log's future for a log scene, else the teacher driven from it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs
import torch

import fgrpo.worlds.driving.sim as sim
from fgrpo.core.config import shown
from fgrpo.worlds.driving.world import HORIZON_STEPS, MAX_SEED, PLAN_DT, SEED_RANGE, TYPES, Scene, generate

PROMPT = re.compile(r"^(?P<type>[a-z-]+) (?P<seed>\d+)(?: t(?P<t>\d+(?:\.\d+)?))?(?: (?P<tag>[a-z0-9:_-]+))?$")
MAX_LOG_TIME = 20.0  #: the latest time a log prompt may name [s]


class ScenePromptError(ValueError):
    """A prompt that names no scene."""


@attrs.frozen
class Parsed:
    kind: int
    seed: int
    t: float
    tag: str | None


def parse(prompt: str) -> Parsed:
    """``"cut-in 42 t2.5"`` -> Parsed(kind=3, seed=42, t=2.5, tag=None); ValueError saying what a
    driving prompt looks like for anything else."""
    match = PROMPT.match(prompt.strip()) if isinstance(prompt, str) else None
    if match is None or match["type"] not in TYPES:
        raise ScenePromptError(
            f"{shown(prompt)} is not a driving scene; expected '<type> <seed> [t<seconds>] [tag]' with a type of "
            f"{', '.join(TYPES)}, e.g. 'cut-in 42 t2.5'"
        )
    digits = match["seed"].lstrip("0") or "0"
    # a longer digit string is no int64 (and past 4300 digits int() itself refuses it)
    if len(digits) > len(str(MAX_SEED)) or int(digits) > MAX_SEED:
        raise ScenePromptError(f"{shown(prompt)}: the seed must be {SEED_RANGE}")
    t = float(match["t"] or 0.0)
    steps = t / PLAN_DT
    if t > MAX_LOG_TIME or abs(steps - round(steps)) > 1e-9:  # the bound first: round(inf) raises
        raise ScenePromptError(
            f"{shown(prompt)}: the time must be a multiple of {PLAN_DT} s up to {MAX_LOG_TIME:g} s, got {t:g}"
        )
    return Parsed(TYPES.index(match["type"]), int(match["seed"]), t, match["tag"])


def prompt_of(kind: int | str, seed: int, t: float = 0.0, tag: str | None = None) -> str:
    name = kind if isinstance(kind, str) else TYPES[kind]
    return f"{name} {seed} t{t:g}" + (f" {tag}" if tag else "")


# --- teacher logs --------------------------------------------------------------------------------


@attrs.define
class Log:
    """One scenario's teacher log: its scenes every PLAN_DT up to ``until`` and the ego's positions
    every PLAN_DT up to ``until`` + the plan horizon (the teacher's plans from every scene)."""

    scenes: Scene  # (K,) at t = 0, 0.5, ...
    positions: torch.Tensor  # (K + HORIZON_STEPS, 2) world-frame ego positions at the same times


_LOGS: dict[tuple[int, int], Log] = {}
_REGISTERED: dict[str, Scene] = {}
_TEACHER_PLANS: dict[str, torch.Tensor] = {}


def teacher_logs(keys: Sequence[tuple[int, int]], until: float) -> None:
    """Make sure the logs of (kind, seed) ``keys`` reach ``until`` seconds (all missing ones in one
    batch; a log that is too short is computed again, longer)."""
    need = sorted({k for k in keys if k not in _LOGS or len(_LOGS[k].scenes) * PLAN_DT <= until})
    if not need:
        return
    until = max([until] + [len(_LOGS[k].scenes) * PLAN_DT for k in need if k in _LOGS])
    logs = _drive_logs(generate([k for k, _ in need], [s for _, s in need]), until)
    _LOGS.update(zip(need, logs, strict=True))


def _drive_logs(scene: Scene, until: float) -> list[Log]:
    """The teacher driving each of the t0 scenes ``scene`` to ``until`` s (+ the plan horizon)."""
    snapshots = int(round(until / PLAN_DT)) + 1
    per = int(round(PLAN_DT / sim.DT))
    scenes, positions = [scene], [scene.ego[:, :2]]
    for k in range(1, snapshots + HORIZON_STEPS):
        for _ in range(per):
            accel, steer = sim.teacher_control(scene)
            scene = sim.advance(scene, accel, steer, reactive=True)
        positions.append(scene.ego[:, :2])
        if k < snapshots:
            scenes.append(scene)
    path = torch.stack(positions, 1)
    out = []
    for i in range(len(scene)):
        log_scenes = Scene.cat([s.index(slice(i, i + 1)) for s in scenes])
        # a log scene's previous plan: the teacher's plan made PLAN_DT earlier (none at t = 0)
        previous = torch.stack([path[i, k : k + HORIZON_STEPS] for k in range(len(scenes))])
        previous[0] = float("nan")
        out.append(Log(scenes=log_scenes.replace(previous_plan=previous), positions=path[i]))
    return out


def register_logs(start: Scene, times: Sequence[float]) -> list[str]:
    """Make the prompts ``"<type> <seed> t<time>"`` (and ``"<type> <seed>"``) of the t0 scenes
    ``start`` name the teacher's log of *these* scenes (a randomised world's training scenarios)
    instead of the generator's; the prompts registered."""
    names: list[str] = []
    for i, log in enumerate(_drive_logs(start, max(times))):
        kind, seed = int(start.kind[i]), int(start.seed[i])
        for t in sorted(set(times) | {0.0}):
            prompt = prompt_of(kind, seed, t)
            k = int(round(t / PLAN_DT))
            _REGISTERED[prompt] = log.scenes.index(slice(k, k + 1))
            ahead = log.positions[k + 1 : k + 1 + HORIZON_STEPS]
            _TEACHER_PLANS[prompt] = sim.world_to_frame(ahead[None], _REGISTERED[prompt].ego)[0]
            names.append(prompt)
        _REGISTERED[f"{TYPES[kind]} {seed}"] = log.scenes.index(slice(0, 1))
    return names


# --- lookup ----------------------------------------------------------------------------------


def register(prompts: Sequence[str], scenes: Scene) -> None:
    """Make each of ``prompts`` name the matching scene of ``scenes`` (replacing what it named)."""
    if len(prompts) != len(scenes):
        raise ValueError(f"{len(prompts)} prompts for {len(scenes)} scenes")
    for i, prompt in enumerate(prompts):
        _REGISTERED[prompt] = scenes.index(slice(i, i + 1))
        _TEACHER_PLANS.pop(prompt, None)


def registered(prompt: str) -> bool:
    return prompt in _REGISTERED


def scenes_for(prompts: Sequence[str]) -> Scene:
    """The batched scenes the prompts name (registered scenes first, else teacher logs)."""
    if not prompts:
        raise ScenePromptError("no prompts")
    parsed = {p: parse(p) for p in prompts if p not in _REGISTERED}
    logs = [(q.kind, q.seed) for q in parsed.values()]
    if logs:
        teacher_logs(logs, max(q.t for q in parsed.values()))
    rows = []
    for prompt in prompts:
        if prompt in _REGISTERED:
            rows.append(_REGISTERED[prompt])
        else:
            q = parsed[prompt]
            rows.append(
                _LOGS[(q.kind, q.seed)].scenes.index(slice(int(round(q.t / PLAN_DT)), int(round(q.t / PLAN_DT)) + 1))
            )
    return Scene.cat(rows)


def teacher_plans(prompts: Sequence[str], scenes: Scene | None = None) -> torch.Tensor:
    """(B, T, 2) the teacher's plan from each prompt's scene, in its ego frame: for a log scene the
    log's next 4 s, else the teacher driven 4 s from the scene (reactive traffic), kept per prompt."""
    scenes = scenes_for(prompts) if scenes is None else scenes
    out = torch.empty(len(prompts), HORIZON_STEPS, 2)
    missing = []
    for i, prompt in enumerate(prompts):
        if prompt in _TEACHER_PLANS:
            out[i] = _TEACHER_PLANS[prompt]
        elif prompt not in _REGISTERED:
            q = parse(prompt)
            k = int(round(q.t / PLAN_DT))
            points = _LOGS[(q.kind, q.seed)].positions[k + 1 : k + 1 + HORIZON_STEPS]
            out[i] = sim.world_to_frame(points[None], scenes.ego[i : i + 1])[0]
        else:
            missing.append(i)
    if missing:
        rows = torch.tensor(missing)
        plans = sim.teacher_plan(scenes.index(rows))
        out[rows] = plans
        for i, plan in zip(missing, plans, strict=True):
            _TEACHER_PLANS[prompts[i]] = plan
    return out


def forget() -> None:
    """Drop every log and registered scene (tests; a process that is done with a world)."""
    _LOGS.clear()
    _REGISTERED.clear()
    _TEACHER_PLANS.clear()
