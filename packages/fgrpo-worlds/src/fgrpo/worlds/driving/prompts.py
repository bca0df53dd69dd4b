"""The ``driving`` prompt source: scenarios by type and seed, held-out seeds per type, starting
states from the teacher's logs or from the policy's own closed loop, and scenario files.

Train prompts are ``"<type> <seed> t<time>"`` for seeds 0 .. ``train_seeds`` - 1 of each type and
each of ``times`` (the scene at that time of the teacher's log); test prompts are the scenarios
at t0 of ``test_seeds`` held-out seeds per type (seeds from :data:`TEST_SEED_BASE` on: never
trained on). The class also tells a planner what a prompt's scene looks like
(:meth:`DrivingPrompts.encode_prompts`, the scene encoding the ``trajectory`` model reads).

``closed_loop`` (a lever): ``{scenarios: K, every: N, times: [...], steps: S}`` adds, for the first
K train scenarios, prompts ``"<type> <seed> t<time> self"`` whose scene is the state the *policy*
reaches at that time when it drives the scenario itself (replanning at 2 Hz among reactive
traffic, its plans sampled deterministically with S Euler steps), recomputed every N iterations
with the current policy (:meth:`refresh`, called by the trainer before an iteration's rollout;
the states travel in checkpoints). Before the first refresh they are the teacher's states.

``scenarios`` (a file): JSON lines, each a scenario of your own (see :func:`read_scenario_file`),
named ``"file <line> ..."``-style prompts are not needed: each becomes a held-out (``split:
test``) or training scenario at t0 under the prompt ``"<type> <seed>"`` it declares.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeGuard

import attrs
import torch

import fgrpo.worlds.driving.features as features
import fgrpo.worlds.driving.highway_starts as highway_starts
import fgrpo.worlds.driving.randomize as randomization
import fgrpo.worlds.driving.scenes as scenes
from fgrpo.core.config import ConfigError, dotted, param, read_text_file, shown
from fgrpo.worlds.driving.world import (
    MAX_AGENTS,
    MAX_DISTANCE,
    MAX_SEED,
    MAX_SPEED,
    SEED_RANGE,
    TYPES,
    Scene,
    generate,
    lane_centre,
)

TEST_SEED_BASE = 1_000_000
SELF_TAG = "self"


def _types(_instance: Any, _attribute: Any, value: Any) -> None:
    bad = [t for t in value or [] if t not in TYPES]
    if not value or bad:
        raise ValueError(f"got {value!r}; allowed: a non-empty list of {', '.join(TYPES)}")


def _times(_instance: Any, _attribute: Any, value: Any) -> None:
    for t in value or []:
        if not isinstance(t, (int, float)) or t < 0 or t > scenes.MAX_LOG_TIME or abs(t / 0.5 - round(t / 0.5)) > 1e-9:
            raise ValueError(
                f"got {value!r}; allowed: times in seconds, multiples of 0.5 from 0 to {scenes.MAX_LOG_TIME:g}"
            )
    if not value:
        raise ValueError(f"got {value!r}; allowed: at least one time")


CLOSED_LOOP_KEYS = ("scenarios", "every", "times", "steps")


def _closed_loop(_instance: Any, _attribute: Any, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping) or set(value) - set(CLOSED_LOOP_KEYS):
        raise ValueError(f"got {value!r}; allowed: null or a mapping with keys {', '.join(CLOSED_LOOP_KEYS)}")
    for key in ("scenarios", "every", "steps"):
        if key in value and (isinstance(value[key], bool) or not isinstance(value[key], int) or value[key] < 1):
            raise ValueError(f"got {key} {value[key]!r}; allowed: an integer >= 1")
    if "times" in value:
        _times(None, None, value["times"])


@attrs.define
class DrivingPrompts:
    """Driving scenarios as prompts (see the module docstring): ``types`` x ``train_seeds`` x
    ``times`` to train on, ``types`` x ``test_seeds`` held-out scenarios at t0 to evaluate on."""

    types: list[str] = param(
        factory=lambda: list(TYPES), validator=_types, help=f"scenario types, of {', '.join(TYPES)}"
    )
    # training seeds stay below the held-out ones, so no test scenario is ever trained on; a
    # million held-out scenarios per type is past any evaluation's budget
    train_seeds: int = param(200, ge=1, le=TEST_SEED_BASE, help="training scenarios per type (seeds 0 .. n - 1)")
    test_seeds: int = param(
        40, ge=0, le=TEST_SEED_BASE, help=f"held-out scenarios per type (seeds {TEST_SEED_BASE} on)"
    )
    times: list[float] = param(
        factory=lambda: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        validator=_times,
        help="starting times of training scenes, seconds into the teacher's log",
    )
    closed_loop: dict | None = param(
        None,
        validator=_closed_loop,
        help="starting states from the policy's own closed loop: {scenarios, every, times, steps}; null = off",
    )
    randomize: dict | None = param(
        None,
        validator=randomization.validate,
        help="the training scenarios' drivers and density drawn per scenario: {key: [low, high]} of "
        f"{', '.join(randomization.KEYS)}; held-out scenarios keep the defaults; null = off",
    )
    highway: dict | None = param(
        None,
        validator=highway_starts.validate,
        help="training starts from highway-env episodes: {episodes, seed, seconds, configs: [{lanes, vehicles, "
        "density, behaviour}]}; null = off",
    )
    scenarios: str | None = param(None, help="a JSON-lines file of your own scenarios (added at t0)")
    split: str = param("test", choices=("train", "test"), help="where the file's scenarios go")
    _train: list[str] = attrs.field(init=False, factory=list, repr=False)
    _test: list[str] = attrs.field(init=False, factory=list, repr=False)
    _self: list[str] = attrs.field(init=False, factory=list, repr=False)
    _refreshed: int | None = attrs.field(init=False, default=None, repr=False)

    #: the size of the scene encoding (the trajectory model's cond_dim)
    encoding_size = features.SIZE
    #: the scenario file's problems shown before a count of the rest
    SHOWN_PROBLEMS: ClassVar[int] = 20

    @classmethod
    def check_keys(cls, values: Mapping[str, Any], prefix: str) -> list[ConfigError]:
        """Every problem of the scenario file, one error each (a file with thousands of bad lines
        shows the first :attr:`SHOWN_PROBLEMS` and counts the rest)."""
        path = values.get("scenarios")
        if path is None:
            return []
        key = dotted(prefix, "scenarios")
        try:
            scenario_rows(path)
        except ScenarioFileError as exc:
            errors = [ConfigError(key, p) for p in exc.problems[: cls.SHOWN_PROBLEMS]]
            if len(exc.problems) > cls.SHOWN_PROBLEMS:
                errors.append(
                    ConfigError(key, f"... and {len(exc.problems) - cls.SHOWN_PROBLEMS} more problems in {path}")
                )
            return errors
        except ValueError as exc:  # read_text_file's line names the file: binary, too large, not UTF-8
            return [ConfigError(key, str(exc))]
        except OSError as exc:
            return [ConfigError(key, f"{path}: cannot be read ({exc.strerror}); allowed: a readable JSON-lines file")]
        return []

    def __attrs_post_init__(self) -> None:
        self._train = [
            scenes.prompt_of(t, s, time) for t in self.types for s in range(self.train_seeds) for time in self.times
        ]
        self._test = [scenes.prompt_of(t, TEST_SEED_BASE + s) for t in self.types for s in range(self.test_seeds)]
        if self.randomize is not None:
            self._register_randomized_logs(self.randomize)
        if self.highway is not None:
            self._train.extend(highway_starts.register_starts(self.highway))
        if self.scenarios is not None:
            names, built = read_scenario_file(self.scenarios)
            scenes.register(names, built)
            (self._train if self.split == "train" else self._test).extend(names)
        if self.closed_loop is not None:
            spec = self._closed_loop_spec()
            pool = [(t, s) for s in range(self.train_seeds) for t in self.types][: spec["scenarios"]]
            self._self = [scenes.prompt_of(t, s, time, SELF_TAG) for t, s in pool for time in spec["times"]]
            self._train.extend(self._self)
            self._register_teacher_states()

    def _register_randomized_logs(self, spec: dict[str, Any]) -> None:
        """The training scenarios drawn by ``randomize``, and the teacher's logs of them at every
        time a training or closed-loop prompt starts from."""
        pairs = [(TYPES.index(t), s) for t in self.types for s in range(self.train_seeds)]
        start = randomization.randomize(generate([k for k, _ in pairs], [s for _, s in pairs]), spec)
        times = set(self.times) | set(self._closed_loop_spec()["times"] if self.closed_loop is not None else [])
        scenes.register_logs(start, sorted(times))

    def _closed_loop_spec(self) -> dict[str, Any]:
        return {
            "scenarios": 32,
            "every": 25,
            "times": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            "steps": 10,
            **(self.closed_loop or {}),
        }

    # --- PromptSource ----------------------------------------------------------------------------

    def train_prompts(self) -> list[str]:
        return list(self._train)

    def test_prompts(self) -> list[str]:
        return list(self._test)

    def metadata(self, prompt: str) -> Mapping[str, Any]:
        return {"category": prompt.split(" ", 1)[0]}

    # --- what a planner reads ----------------------------------------------------------------------

    @staticmethod
    def encode_prompts(prompts: Sequence[str]) -> torch.Tensor:
        """(B, 38) the scene encoding of each prompt's scene (:mod:`fgrpo.worlds.driving.features`)."""
        return features.encode(scenes.scenes_for(list(prompts)))

    @staticmethod
    def check_prompts(prompts: Sequence[str]) -> list[str]:
        problems = []
        for prompt in prompts:
            if scenes.registered(prompt):
                continue
            try:
                scenes.parse(prompt)
            except ValueError as exc:
                problems.append(str(exc))
        return problems

    # --- starting states from the policy's own closed loop ----------------------------------------

    def _register_teacher_states(self) -> None:
        scenes.register(self._self, scenes.scenes_for([p.rsplit(" ", 1)[0] for p in self._self]))

    def refresh(self, policy: Any, iteration: int, seed: int = 0) -> bool:
        """Every ``closed_loop.every`` iterations: drive the closed-loop scenarios with ``policy``
        and register the states it reaches under the ``self`` prompts. True when it refreshed."""
        if not self._self:
            return False
        spec = self._closed_loop_spec()
        if iteration % spec["every"] or self._refreshed == iteration:
            return False
        from fgrpo.core.evaluation import generate
        from fgrpo.worlds.driving.closed_loop import drive, policy_planner

        base = list(dict.fromkeys(p.rsplit(" ", 2)[0] for p in self._self))  # "<type> <seed>"
        times = sorted(set(spec["times"]))

        def sample(names: Sequence[str], per_prompt: int, g: torch.Generator) -> torch.Tensor:
            return generate(policy, list(names), per_prompt, spec["steps"], g)

        with torch.no_grad():
            result = drive(
                policy_planner(sample, "own", seed * 1000003 + iteration),
                scenes.scenes_for(base),
                max(times),
                keep=times,
            )
        index = {name: i for i, name in enumerate(base)}
        rows = []
        for prompt in self._self:
            head, t_text, _ = prompt.rsplit(" ", 2)
            rows.append(result.snapshots[float(t_text[1:])].index(slice(index[head], index[head] + 1)))
        scenes.register(self._self, Scene.cat(rows))
        self._refreshed = iteration
        return True

    def state_dict(self) -> dict[str, Any]:
        if not self._self:
            return {}
        return {"refreshed": self._refreshed, "scenes": scenes.scenes_for(self._self).to_rows()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._self and state.get("scenes"):
            scenes.register(self._self, Scene.from_rows(state["scenes"]))
            self._refreshed = state.get("refreshed")


# --- scenario files --------------------------------------------------------------------------------

SCENARIO_KEYS = ("type", "seed", "lanes", "speed_limit", "ego", "agents")


class ScenarioFileError(ValueError):
    """Every problem of a scenario file, one line each (``FILE:LINE: key: got ...; allowed ...``)."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def read_scenario_file(path: str | Path) -> tuple[list[str], Scene]:
    """Scenarios from a JSON-lines file, one per line::

        {"type": "stopped", "seed": 7, "lanes": 3, "speed_limit": 25,
         "ego": {"lane": 1, "speed": 20},
         "agents": [{"lane": 1, "x": 60, "speed": 0}, {"lane": 2, "x": -20, "speed": 24}]}

    ``type``/``seed`` name the prompt (and the teacher's flaws); 1 to 6 lanes; the limit and the
    speeds at most :data:`~fgrpo.worlds.driving.world.MAX_SPEED`, the cars within
    :data:`~fgrpo.worlds.driving.world.MAX_DISTANCE` of the ego, lane indices inside the road.
    Every problem of the file is one line of a :class:`ScenarioFileError`."""
    return _build(scenario_rows(path))


def scenario_rows(path: str | Path) -> list[dict[str, Any]]:
    """The scenarios of the file as JSON objects, every one checked (see :func:`read_scenario_file`);
    nothing is built."""
    path = Path(path)
    allowed = "allowed: a JSON-lines file, a scenario per line"
    if not path.is_file():
        raise ScenarioFileError([f"{path}: {'is a folder' if path.is_dir() else 'no such file'}; {allowed}"])
    problems, rows = [], []
    for number, line in enumerate(read_text_file(path, limit=16 << 20, what="a scenario file").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            problems.append(f"{where}: not a JSON object ({exc})")
            continue
        except RecursionError:
            problems.append(f"{where}: not a JSON object (nested too deeply)")
            continue
        found = _scenario_problems(row)
        problems += [f"{where}: {p}" for p in found]
        if not found:
            rows.append(row)
    if problems:
        raise ScenarioFileError(problems)
    if not rows:
        raise ScenarioFileError([f"{path}: no scenarios; {allowed}"])
    return rows


def _number(value: Any, low: float = -math.inf, high: float = math.inf) -> TypeGuard[float]:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        number = float(value)
    except OverflowError:  # an integer past any float: JSON holds it
        return False
    return math.isfinite(number) and low <= number <= high


def _scenario_problems(row: Any) -> list[str]:
    if not isinstance(row, dict):
        return [f"expected an object with keys {', '.join(SCENARIO_KEYS)}"]
    out = [f"{k}: unknown key; allowed: {', '.join(SCENARIO_KEYS)}" for k in row if k not in SCENARIO_KEYS]
    if row.get("type") not in TYPES:
        out.append(f"type: got {row.get('type')!r}; allowed: {', '.join(TYPES)}")
    seed = row.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        out.append(f"seed: got {shown(seed)}; allowed: {SEED_RANGE}")
    lanes = row.get("lanes")
    if not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= 6:
        out.append(f"lanes: got {shown(lanes)}; allowed: 1 to 6 (a scene needs a lane)")
        lanes = None
    limit = row.get("speed_limit")
    if not _number(limit, high=MAX_SPEED) or limit <= 0:
        out.append(f"speed_limit: got {shown(limit)}; allowed: a number > 0 and <= {MAX_SPEED:g} (m/s)")
    agents = row.get("agents") or []
    cars = [("ego", row.get("ego"))]
    if not isinstance(agents, list) or len(agents) > MAX_AGENTS:
        out.append(f"agents: got {shown(agents)}; allowed: a list of at most {MAX_AGENTS} cars")
    else:
        cars += [(f"agents.{i}", a) for i, a in enumerate(agents)]
    for key, car in cars:
        if not isinstance(car, dict):
            out.append(f"{key}: got {shown(car)}; allowed: an object with lane, speed (and x for agents)")
            continue
        speed = car.get("speed")
        if not _number(speed, 0.0, MAX_SPEED):
            out.append(f"{key}.speed: got {shown(speed)}; allowed: a finite number from 0 to {MAX_SPEED:g} (m/s)")
        lane = car.get("lane")
        if not isinstance(lane, int) or isinstance(lane, bool) or lane < 0 or (lanes is not None and lane >= lanes):
            out.append(
                f"{key}.lane: got {shown(lane)}; allowed: an integer from 0 to {lanes - 1 if lanes else 'lanes - 1'}"
            )
        if key != "ego" and not _number(car.get("x"), -MAX_DISTANCE, MAX_DISTANCE):
            out.append(
                f"{key}.x: got {shown(car.get('x'))}; allowed: a finite number from {-MAX_DISTANCE:g} to "
                f"{MAX_DISTANCE:g} (m ahead of the ego; negative: behind)"
            )
    return out


def _build(rows: Sequence[dict[str, Any]]) -> tuple[list[str], Scene]:
    base = generate([TYPES.index(r["type"]) for r in rows], [r["seed"] for r in rows])  # teacher flaws, IDM defaults
    n = MAX_AGENTS
    for b, row in enumerate(rows):
        width = float(base.lane_width[b])
        base.road[b, 0] = row["lanes"]
        base.road[b, 2] = float(row["speed_limit"])
        base.ego[b] = torch.tensor(
            [
                0.0,
                float(lane_centre(torch.tensor(float(row["ego"]["lane"])), torch.tensor(width))),
                0.0,
                float(row["ego"]["speed"]),
                0.0,
            ]
        )
        base.valid[b] = False
        base.agents[b] = torch.tensor([1.0e4, 0.0, 0.0, 0.0]).expand(n, 4)
        base.lane_change[b] = 0.0
        for i, car in enumerate(row.get("agents") or []):
            y = float(lane_centre(torch.tensor(float(car["lane"])), torch.tensor(width)))
            base.valid[b, i] = True
            base.agents[b, i] = torch.tensor([float(car["x"]), y, 0.0, float(car["speed"])])
            base.idm[b, i, 0] = float(car["speed"])
            base.lane_change[b, i] = torch.tensor([y, y, 0.0, 0.0])
    names = [scenes.prompt_of(r["type"], r["seed"], 0.0, "file") for r in rows]
    return names, base
