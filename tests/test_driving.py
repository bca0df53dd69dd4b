"""The driving recipes end to end: they validate, pass the on-policy check, run with the closed-loop
gold per scenario type and its pictures in the report, resume bit-exactly (starting states from
the policy's own closed loop and the guard included), and refuse bad input with one line each."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from _helpers import crash_after
from fgrpo.core import cli
from fgrpo.core.runlog import read_metrics
from fgrpo.worlds.driving.world import TYPES

#: a small world and short evaluations: seconds, not minutes
SMALL = [
    "prompts.train_seeds=3",
    "prompts.test_seeds=1",
    "prompts.times=[0, 1]",
    "train.prompts_per_iteration=4",
    "train.group_size=4",
    "eval.steps=4",
    "eval.samples_per_prompt=2",
    "evaluator.seconds=3",
    "sampler.steps=4",
]
CLOSED_LOOP = ["prompts.closed_loop={scenarios: 3, every: 2, times: [0.5, 1], steps: 4}"]


def sets(*items: str) -> list[str]:
    out = []
    for item in items:
        out += ["--set", item]
    return out


@pytest.mark.parametrize("name", ["driving-nft.yaml", "driving-naive.yaml"])
def test_driving_recipes_validate_and_pass_the_on_policy_check(root, name, capsys):
    recipe = str(root / "recipes" / name)
    assert cli.main(["validate", recipe]) == 0
    assert cli.main(["check", recipe, *sets(*SMALL, "prompts.closed_loop=null")]) == 0
    assert "on-policy check passed" in capsys.readouterr().out


def test_a_short_run_logs_gold_per_type_and_draws_scenes(root, tmp_path):
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "compose",
                str(root / "recipes" / "driving-nft.yaml"),
                "--out",
                str(out),
                "--quiet",
                *sets(*SMALL, *CLOSED_LOOP, "train.iterations=2", "eval.every=2"),
            ]
        )
        == 0
    )
    rows = read_metrics(out)
    evals = [r for r in rows if "gold/driving-closed-loop/cl_score" in r]
    assert [r["iteration"] for r in evals] == [0, 2]
    for row in evals:
        for metric in ("cl_score", "collision", "off_road", "progress", "stuck", "jerk"):
            assert all(f"gold/driving-closed-loop/{metric}/{t}" in row for t in TYPES), metric
        assert "eval/driving-rollout/rollout/cut-in" in row  # the proxy per type too
    assert (
        rows[1]["prompts_refreshed"] == 1.0
    )  # the starting states of iteration 0 came from the policy's own closed loop
    page = (out / "report.html").read_text()
    assert 'id="fig-gold-driving-closed-loop"' in page and 'id="fig-gold-driving-closed-loop-types"' in page
    tiles = json.loads((out / "samples" / "gold_000002" / "driving-closed-loop" / "index.json").read_text())
    assert len(tiles) == 5 and all(t["read"].startswith("CL ") for t in tiles)
    grid = json.loads((out / "samples" / "eval_000002" / "index.json").read_text())
    assert len(grid) == 5 and "m/s, progress" in grid[0]["read"]  # top-down scenes with their plans


def test_resume_is_bit_exact_with_closed_loop_states(root, tmp_path):
    recipe = str(root / "recipes" / "driving-nft.yaml")
    common = sets(*SMALL, *CLOSED_LOOP, "train.iterations=4", "eval.every=2", "train.checkpoint_every=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli.main(["compose", recipe, "--out", str(straight), "--quiet", *common]) == 0
    with crash_after(3):
        assert cli.main(["compose", recipe, "--out", str(resumed), "--quiet", *common]) == 130
    assert cli.main(["compose", recipe, "--out", str(resumed), "--quiet", "--resume", *common]) == 0
    a = load_file(str(straight / "checkpoints" / "last" / "trainable.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "last" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = ("reward_mean", "gold/driving-closed-loop/cl_score", "gold/driving-closed-loop/jerk", "guard/streak")
    assert [[r.get(k) for k in keys] for r in read_metrics(straight)] == [
        [r.get(k) for k in keys] for r in read_metrics(resumed)
    ]


def test_bad_scenario_file_is_one_line_each_and_exit_2(root, tmp_path, capsys):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"type": "stopped", "seed": 1, "lanes": 0, "speed_limit": 30, "ego": {"lane": 0, "speed": 20}}\n'
        '{"type": "stopped", "seed": 2, "lanes": 2, "speed_limit": 30, "ego": {"lane": 0, "speed": -5}}\n'
    )
    assert cli.main(["validate", str(root / "recipes" / "driving-nft.yaml"), *sets(f"prompts.scenarios={path}")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: prompts.scenarios: {path}:1: lanes: got 0; allowed: 1 to 6 (a scene needs a lane)",
        f"error: prompts.scenarios: {path}:2: ego.speed: got -5; allowed: a finite number from 0 to 60 (m/s)",
        "2 error(s); nothing was run.",
    ]


def test_nan_waypoints_stop_the_run_with_one_line(root, tmp_path, capsys):
    from fgrpo.worlds.driving.planner import default_weights_path

    state = load_file(default_weights_path())
    state["out.bias"] = torch.full_like(state["out.bias"], float("nan"))
    from safetensors import safe_open

    with safe_open(default_weights_path(), framework="pt") as f:
        meta = f.metadata()
    broken = tmp_path / "nan.safetensors"
    save_file(state, str(broken), metadata=meta)
    code = cli.main(
        [
            "compose",
            str(root / "recipes" / "driving-nft.yaml"),
            "--out",
            str(tmp_path / "run"),
            "--quiet",
            *sets(*SMALL, f"model.path={broken}", "eval.every=0", "train.iterations=1"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "error: reward 'driving-rollout' raised ValueError: driving-rollout: plans 0, 1, 2, ... (16 of 16) have "
        "NaN or infinite waypoints; allowed: finite, |x|, |y| <= 1000 m (a diverged policy: resume from a checkpoint, "
        "lower train.lr) on the batch of iteration 0 (16 samples of the prompts "
    )


def test_the_highway_evaluator_runs_beside_the_gold(root, tmp_path):
    pytest.importorskip("highway_env")
    out = tmp_path / "run"
    highway = "evaluator=[driving-closed-loop, {name: driving-highway, episodes: 2, seconds: 2, vehicles: 5}]"
    recipe = str(root / "recipes" / "driving-nft.yaml")
    sets_ = sets(*SMALL, highway, "train.iterations=1", "eval.every=1")
    assert cli.main(["compose", recipe, "--out", str(out), "--quiet", *sets_]) == 0
    evals = [r for r in read_metrics(out) if "gold/driving-highway/cl_score" in r]
    assert [r["iteration"] for r in evals] == [0, 1]
    for row in evals:
        assert {"collision", "off_road", "progress", "speed", "jerk"} <= {
            k.rsplit("/", 1)[1] for k in row if k.startswith("gold/driving-highway/")
        }
        assert 0.0 <= row["gold/driving-highway/cl_score"] <= 1.0 and row["gold/driving-highway/speed"] > 10.0
