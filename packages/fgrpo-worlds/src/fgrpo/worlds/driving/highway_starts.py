"""Training starts from highway-env (``prompts.highway``): the states highway-env's own IDM + MOBIL
driver reaches in ``highway-v0`` episodes under configurations a recipe lists, read into our
scenes (:func:`~fgrpo.worlds.driving.highway.read_scenes`, each car with its highway-env IDM
parameters) and driven on by our reactive traffic, so a planner trains on the traffic it is judged
in without stepping highway-env in the loop (12 ms a step, one episode at a time).

A start is the prompt ``"dense <episode seed> t<time> highway<i>"`` (configuration i of the list;
``dense`` is the scenario type the scenes are counted under). Episodes are highway-env's seeds
``seed``, ``seed + 1``, ...: keep them and the configurations apart from the evaluation's
(``driving-highway``'s seeds from 10,000; docs/planners.md names the configurations).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import fgrpo.worlds.driving.scenes as scenes
from fgrpo.worlds.driving.world import MAX_SEED, PLAN_DT, Scene

CONFIG_KEYS = {"lanes": (2, 6), "vehicles": (0, 100), "density": (0.1, 4.0)}
BEHAVIOURS = ("idm", "aggressive", "defensive", "linear")
KEYS = ("episodes", "seed", "seconds", "configs")
#: the configurations trained on when a recipe names none: none of them is one the evaluation uses
DEFAULT_CONFIGS = (
    {"lanes": 2, "vehicles": 15, "density": 1.0, "behaviour": "idm"},
    {"lanes": 3, "vehicles": 20, "density": 1.0, "behaviour": "idm"},
    {"lanes": 4, "vehicles": 40, "density": 1.3, "behaviour": "idm"},
    {"lanes": 5, "vehicles": 45, "density": 1.0, "behaviour": "idm"},
    {"lanes": 4, "vehicles": 25, "density": 1.0, "behaviour": "linear"},
)
HORIZON = 4.0  #: s of each episode after its last start (the driver's 4 s plan)


def _config_problems(i: int, config: Any) -> list[str]:
    where = f"configs.{i}"
    if not isinstance(config, Mapping):
        return [f"{where}: got {config!r}; allowed: a mapping of lanes, vehicles, density, behaviour"]
    out = [f"{where}.{k}: unknown key" for k in config if k not in (*CONFIG_KEYS, "behaviour")]
    for key, (low, high) in CONFIG_KEYS.items():
        value = config.get(key)
        if key in config and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high
        ):
            out.append(f"{where}.{key}: got {value!r}; allowed: a number from {low:g} to {high:g}")
    if config.get("behaviour", "idm") not in BEHAVIOURS:
        out.append(f"{where}.behaviour: got {config['behaviour']!r}; allowed: {', '.join(BEHAVIOURS)}")
    return out


def validate(_instance: Any, _attribute: Any, value: Any) -> None:
    """``prompts.highway``: null or {episodes, seed, seconds, configs}."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ValueError(f"got {value!r}; allowed: null or a mapping with keys {', '.join(KEYS)}")
    problems = [f"{k}: unknown key" for k in value if k not in KEYS] + _missing_highway_env()
    episodes, seed, seconds = value.get("episodes", 8), value.get("seed", 0), value.get("seconds", 10.0)
    if isinstance(episodes, bool) or not isinstance(episodes, int) or not 1 <= episodes <= 1000:
        problems.append(f"episodes: got {episodes!r}; allowed: an integer from 1 to 1000 (per configuration)")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED - 1000:
        problems.append(f"seed: got {seed!r}; allowed: an integer from 0 to {MAX_SEED - 1000}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not HORIZON + PLAN_DT <= seconds <= 60:
        problems.append(f"seconds: got {seconds!r}; allowed: from {HORIZON + PLAN_DT:g} to 60")
    configs = value.get("configs", DEFAULT_CONFIGS)
    if not isinstance(configs, (list, tuple)) or not configs:
        problems.append(f"configs: got {configs!r}; allowed: a non-empty list of configurations")
    else:
        for i, config in enumerate(configs):
            problems += _config_problems(i, config)
    if problems:
        raise ValueError("; ".join(problems))


def _missing_highway_env() -> list[str]:
    try:
        import highway_env  # noqa: F401
    except ImportError:
        return ['needs highway-env, which is not installed: pip install "fgrpo-worlds[highway]"']
    return []


def register_starts(spec: Mapping[str, Any]) -> list[str]:
    """Drive the episodes of ``spec`` (see the module docstring), register their states every 0.5 s
    under their prompts and return the prompts."""
    names: list[str] = []
    rows: list[Scene] = []
    for i, config in enumerate(spec.get("configs", DEFAULT_CONFIGS)):
        starts = driven_starts(
            int(spec.get("episodes", 8)),
            int(spec.get("seed", 0)),
            float(spec.get("seconds", 10.0)),
            int(config.get("lanes", 4)),
            int(config.get("vehicles", 30)),
            float(config.get("density", 1.0)),
            str(config.get("behaviour", "idm")),
        )
        names += [
            scenes.prompt_of("dense", int(s), float(t), f"highway{i}")
            for s, t in zip(starts.seed, starts.t, strict=True)
        ]
        rows.append(starts)
    scenes.register(names, Scene.cat(rows))
    return names


@functools.lru_cache(maxsize=64)
def driven_starts(
    episodes: int, seed: int, seconds: float, lanes: int, vehicles: int, density: float, behaviour: str
) -> Scene:
    """The states of :func:`~fgrpo.worlds.driving.shadow.highway_drives`, kept for the process: a
    recipe's later stages (``then:``) train on the same starts, which took 49 s of one thread to drive
    for the default configurations. Read only: :meth:`Scene.cat` copies."""
    from fgrpo.worlds.driving.shadow import highway_drives

    return highway_drives(episodes, seed, seconds, lanes, vehicles, density, behaviour)[0]
