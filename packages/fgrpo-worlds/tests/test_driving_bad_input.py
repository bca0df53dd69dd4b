"""Bad input to the driving world is one line each, naming the file and line or the key, the bad
value and what is allowed, all at once and never a traceback: scenario files (values outside the
world's physics, seeds a scenario cannot hold), prompts, the seed and count keys of its
components, and plans with absurd or non-finite waypoints, refused by every reward."""

from __future__ import annotations

import json
import types

import pytest
import torch

from fgrpo.core import cli, registry, scoring
from fgrpo.core.config import RecipeError, check_params
from fgrpo.worlds.driving import prompts, scenes
from fgrpo.worlds.driving.world import HORIZON_STEPS, generate

SEED_RANGE = "an integer from 0 to 2**63 - 1 (9223372036854775807)"
TERMS = ("safety", "drivable", "rules", "comfort", "progress", "imitation", "consistency", "pdms", "carl")
REWARDS = tuple(f"driving-{t}" for t in TERMS) + ("driving-rollout",)


def scenario(**changes) -> dict:
    row = {
        "type": "stopped",
        "seed": 7,
        "lanes": 3,
        "speed_limit": 25,
        "ego": {"lane": 1, "speed": 20},
        "agents": [{"lane": 1, "x": 60, "speed": 0}],
    }
    return {**row, **changes}


def write(path, *rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def scenario_errors(path: str) -> list[str]:
    _, errors = check_params(prompts.DrivingPrompts, {"scenarios": path}, "prompts")
    return [str(e) for e in errors]


# --- scenario files -------------------------------------------------------------------------------


def test_scenario_values_outside_the_world_are_one_line_each(tmp_path):
    huge = 10**400  # JSON holds it; no float does
    path = write(
        tmp_path / "mine.jsonl",
        scenario(ego={"lane": 1, "speed": 1e308}),
        scenario(seed=2**70),
        scenario(speed_limit=1e308, agents=[{"lane": 1, "x": 1e308, "speed": 1e308}]),
        scenario(seed=-1, speed_limit=huge, agents=[{"lane": 0, "x": huge, "speed": 61}]),
        scenario(agents=5),
        "[" * 100_000,
        # the edges of every range are allowed
        scenario(
            seed=2**63 - 1, speed_limit=60, ego={"lane": 0, "speed": 60}, agents=[{"lane": 2, "x": -1000, "speed": 0}]
        ),
    )
    where = f"prompts.scenarios: {path}"
    speed = "allowed: a finite number from 0 to 60 (m/s)"
    limit = "allowed: a number > 0 and <= 60 (m/s)"
    x = "allowed: a finite number from -1000 to 1000 (m ahead of the ego; negative: behind)"
    shown_huge = "100000000000000000...0000000000000000000"
    assert scenario_errors(path) == [
        f"{where}:1: ego.speed: got 1e+308; {speed}",
        f"{where}:2: seed: got {2**70}; allowed: {SEED_RANGE}",
        f"{where}:3: speed_limit: got 1e+308; {limit}",
        f"{where}:3: agents.0.speed: got 1e+308; {speed}",
        f"{where}:3: agents.0.x: got 1e+308; {x}",
        f"{where}:4: seed: got -1; allowed: {SEED_RANGE}",
        f"{where}:4: speed_limit: got {shown_huge}; {limit}",
        f"{where}:4: agents.0.speed: got 61; {speed}",
        f"{where}:4: agents.0.x: got {shown_huge}; {x}",
        f"{where}:5: agents: got 5; allowed: a list of at most 12 cars",
        f"{where}:6: not a JSON object (nested too deeply)",
    ]


def test_the_largest_seed_and_fastest_cars_make_a_scene(tmp_path):
    path = write(
        tmp_path / "edge.jsonl",
        scenario(
            seed=2**63 - 1, speed_limit=60, ego={"lane": 0, "speed": 60}, agents=[{"lane": 2, "x": -1000, "speed": 60}]
        ),
    )
    names, built = prompts.read_scenario_file(path)
    assert names == [f"stopped {2**63 - 1} t0 file"] and int(built.seed[0]) == 2**63 - 1
    assert float(built.ego[0, 3]) == 60 and float(built.agents[0, 0, 0]) == -1000
    assert torch.isfinite(generate([0], [2**63 - 1]).ego).all()


def test_many_bad_scenarios_are_shown_with_a_count_of_the_rest(tmp_path):
    path = write(tmp_path / "many.jsonl", *[scenario(seed=-1)] * 30)
    errors = scenario_errors(path)
    assert len(errors) == 21 and errors[:20] == [
        f"prompts.scenarios: {path}:{n}: seed: got -1; allowed: {SEED_RANGE}" for n in range(1, 21)
    ]
    assert errors[20] == f"prompts.scenarios: ... and 10 more problems in {path}"


def test_a_bad_scenario_file_fails_validate_with_exit_2_and_no_traceback(tmp_path, capsys):
    path = write(tmp_path / "mine.jsonl", scenario(ego={"lane": 1, "speed": 1e308}), scenario(seed=2**70))
    assert cli.main(["validate", "driving", "--set", f"prompts.scenarios={path}"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    assert captured.err.splitlines() == [
        f"error: prompts.scenarios: {path}:1: ego.speed: got 1e+308; allowed: a finite number from 0 to 60 (m/s)",
        f"error: prompts.scenarios: {path}:2: seed: got {2**70}; allowed: {SEED_RANGE}",
        "2 error(s); nothing was run.",
    ]


def test_scenario_file_errors_come_with_the_other_keys_errors(tmp_path):
    """The file is read only once the other keys are valid (its checks run after them), so a
    wrong key is reported alone first; a built source gets the file's problems as one error."""
    path = write(tmp_path / "mine.jsonl", scenario(seed=2**70))
    _, errors = check_params(prompts.DrivingPrompts, {"scenarios": path, "train_seeds": 0}, "prompts")
    assert [str(e) for e in errors] == ["prompts.train_seeds: got 0; allowed: >= 1 and <= 1000000"]
    with pytest.raises(RecipeError) as info:
        registry.create("prompts", "driving", scenarios=path, train_seeds=1, test_seeds=0)
    assert str(info.value) == f"prompts.scenarios: {path}:1: seed: got {2**70}; allowed: {SEED_RANGE}"


def test_a_missing_empty_or_folder_scenario_file_is_one_line(tmp_path):
    allowed = "allowed: a JSON-lines file, a scenario per line"
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert [scenario_errors(str(tmp_path / name)) for name in ("nosuch.jsonl", "empty.jsonl", "")] == [
        [f"prompts.scenarios: {tmp_path / 'nosuch.jsonl'}: no such file; {allowed}"],
        [f"prompts.scenarios: {tmp_path / 'empty.jsonl'}: no scenarios; {allowed}"],
        [f"prompts.scenarios: {tmp_path}: is a folder; {allowed}"],
    ]
    (tmp_path / "latin1.jsonl").write_bytes(b"caf\xe9\n")
    assert scenario_errors(str(tmp_path / "latin1.jsonl")) == [
        f"prompts.scenarios: {tmp_path / 'latin1.jsonl'}: not UTF-8 text (byte 0xe9 at offset 3); save it as UTF-8"
    ]


# --- prompts and recipe keys ----------------------------------------------------------------------


def test_a_prompt_seed_outside_int64_is_one_line():
    for seed in (str(2**63), str(10**21), "9" * 5000):  # 5000 digits: past what int() reads
        with pytest.raises(scenes.ScenePromptError) as info:
            scenes.parse(f"free {seed} t0")
        assert str(info.value).endswith(f"the seed must be {SEED_RANGE}") and "\n" not in str(info.value)
        assert len(str(info.value)) < 300
    assert scenes.parse(f"free {2**63 - 1}").seed == 2**63 - 1
    with pytest.raises(scenes.ScenePromptError, match=r"the time must be a multiple of 0.5 s up to 20 s, got inf$"):
        scenes.parse("free 1 t" + "9" * 400)
    problems = prompts.DrivingPrompts.check_prompts(["free 3 t0", f"cut-in {2**70}"])
    assert problems == [f"'cut-in {2**70}': the seed must be {SEED_RANGE}"]


@pytest.mark.parametrize(
    ("kind", "name", "key", "value", "allowed"),
    [
        ("prompts", "driving", "train_seeds", 10**20, "allowed: >= 1 and <= 1000000"),
        ("prompts", "driving", "test_seeds", 10**20, "allowed: >= 0 and <= 1000000"),
        ("evaluator", "driving-highway", "seed", 2**70, "allowed: >= 0 and <= 9223372036854765807"),
        ("model", "trajectory", "init", 2**70, "allowed: >= 0 and <= 9223372036854775807"),
        ("model", "trajectory", "init", -1, "allowed: >= 0 and <= 9223372036854775807"),
    ],
)
def test_seed_and_count_keys_have_a_range(kind, name, key, value, allowed):
    _, errors = check_params(registry.load(kind, name), {key: value}, kind)
    assert [str(e) for e in errors] == [f"{kind}.{key}: got {value}; {allowed}"]


# --- waypoints ------------------------------------------------------------------------------------


def plans(n: int = 3) -> torch.Tensor:
    t = torch.arange(1, HORIZON_STEPS + 1, dtype=torch.float32) * 0.5
    return torch.stack([20.0 * t, torch.zeros_like(t)], -1).expand(n, -1, -1).clone()


ALLOWED = "allowed: finite, |x|, |y| <= 1000 m (a diverged policy: resume from a checkpoint, lower train.lr)"


@pytest.mark.parametrize("name", REWARDS)
def test_absurd_or_non_finite_waypoints_are_refused_by_every_reward(name):
    prompt_list = ["free 1", "free 1", "free 2"]
    reward = registry.create("reward", name)
    absurd = plans()
    absurd[1] = 1e30
    absurd[2, 4, 1] = -3e38
    with pytest.raises(ValueError) as info:
        reward(absurd, prompt_list, [{}] * 3)
    assert str(info.value) == f"{name}: plans 1, 2 (2 of 3) have waypoints up to 3e+38 m; {ALLOWED}"
    broken = plans()
    broken[0, 3, 0] = float("nan")
    broken[2, 0, 1] = 1e4
    with pytest.raises(ValueError) as info:
        reward(broken, prompt_list, [{}] * 3)
    assert str(info.value) == f"{name}: plans 0, 2 (2 of 3) have NaN, infinite or far waypoints; {ALLOWED}"
    broken[2, 0, 1] = 0.0
    with pytest.raises(ValueError) as info:
        reward(broken, prompt_list, [{}] * 3)
    assert str(info.value) == f"{name}: plan 0 (1 of 3) has NaN or infinite waypoints; {ALLOWED}"
    edge = plans()
    edge[1, :, 0] = 1000.0
    edge[2, :, 1] = -1000.0
    scores = reward(edge, prompt_list, [{}] * 3).scores
    assert scores.shape == (3,) and torch.isfinite(scores).all()


def test_a_diverged_policy_stops_scoring_with_one_line():
    absurd = plans(5)
    absurd[1:] = 1e30
    spec = types.SimpleNamespace(label="comfort")
    with pytest.raises(scoring.RewardError) as info:
        scoring.score(
            [(spec, registry.create("reward", "driving-comfort"))],
            absurd,
            ["free 1"] * 5,
            [{}] * 5,
            where="iteration 3",
        )
    assert str(info.value) == (
        "reward 'comfort' raised ValueError: driving-comfort: plans 1, 2, 3, ... (4 of 5) have waypoints up to "
        f"1e+30 m; {ALLOWED} on iteration 3 (5 samples of the prompts 'free 1')"
    )
