"""Hand-made driving scenes and plans for tests (the scenario-file format, registered under a prompt)."""

from __future__ import annotations

import torch

from fgrpo.worlds.driving import prompts, scenes
from fgrpo.worlds.driving.world import HORIZON_STEPS, PLAN_DT

#: the plan's waypoint times (s)
T = torch.arange(1, HORIZON_STEPS + 1, dtype=torch.float32) * PLAN_DT


def custom(name: str, lanes: int = 3, limit: float = 30.0, ego: tuple[int, float] = (1, 20.0), agents=()) -> str:
    """Register a hand-made scene (the scenario-file format: ``agents`` as (lane, x, speed)) under a
    prompt of its own, and return that prompt."""
    row = {
        "type": "free",
        "seed": 0,
        "lanes": lanes,
        "speed_limit": limit,
        "ego": {"lane": ego[0], "speed": ego[1]},
        "agents": [{"lane": lane, "x": x, "speed": v} for lane, x, v in agents],
    }
    problems = prompts._scenario_problems(row)
    if problems:
        raise ValueError(problems)
    _, scene = prompts._build([row])
    prompt = f"free 0 t0 {name}"
    scenes.register([prompt], scene)
    return prompt


def constant_speed(v: float, y: float = 0.0, n: int = 1) -> torch.Tensor:
    """(n, T, 2) plans holding ``v`` m/s at lateral offset ``y``."""
    return torch.stack([v * T, torch.full_like(T, y)], -1).expand(n, -1, -1).clone()
