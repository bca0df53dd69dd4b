"""The driving world: flow-matching planners trained by Flow-GRPO, judged in closed loop.

A seeded world in torch, batched throughout: a straight road of 2-4 lanes, an ego car and up to
12 others driving by IDM, five scenario types (free road, slow lead, stopped car, cut-in, dense
traffic). Everything a run needs is a pure function of a prompt such as ``"cut-in 42 t2.5"``:

- :mod:`.world`: the scene batch and the scenario generator (a pure function of (type, seed));
- :mod:`.sim`: IDM, the kinematic bicycle, the tracking controller that executes a plan,
  collisions, time to collision, and the flawed IDM+MOBIL **teacher** that makes the logs;
- :mod:`.scenes`: prompt -> scene (teacher logs computed on first use; registered scenes), the
  teacher's plan from any scene;
- :mod:`.features`: the 38-number scene encoding a planner conditions on;
- :mod:`.rewards`: the open-loop reward terms, each a registered reward (``driving-safety``,
  ``-drivable``, ``-rules``, ``-comfort``, ``-progress``, ``-imitation``, ``-consistency``, the
  combined ``-pdms`` and CaRL's multiplicative ``-carl``), all from one non-reactive simulation;
- :mod:`.prompts`: the ``driving`` prompt source (held-out seeds per type, starting states from
  the policy's own closed loop, scenario files);
- :mod:`.closed_loop`: the ``driving-closed-loop`` evaluator, the gold metric: 12 s among
  reactive traffic, replanning at 2 Hz (collision, off-road, progress, stuck, jerk, CL-score);
  and ``driving-rollout``, the closed loop as a reward (a plan's first 0.5 s, then the teacher);
- :mod:`.draw`: top-down pictures for sample grids and the report.
"""

from fgrpo.worlds.driving.closed_loop import ClosedLoop, Rollout, drive
from fgrpo.worlds.driving.prompts import DrivingPrompts, read_scenario_file
from fgrpo.worlds.driving.rewards import (
    PDMS,
    CaRL,
    Comfort,
    Consistency,
    Drivable,
    Imitation,
    Progress,
    Rules,
    Safety,
)
from fgrpo.worlds.driving.scenes import parse, prompt_of, scenes_for, teacher_plans
from fgrpo.worlds.driving.world import TYPES, Scene, generate

__all__ = [
    "PDMS",
    "TYPES",
    "CaRL",
    "ClosedLoop",
    "Comfort",
    "Consistency",
    "Drivable",
    "DrivingPrompts",
    "Imitation",
    "Progress",
    "Rollout",
    "Rules",
    "Safety",
    "Scene",
    "drive",
    "generate",
    "parse",
    "prompt_of",
    "read_scenario_file",
    "scenes_for",
    "teacher_plans",
]
