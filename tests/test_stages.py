"""Recipes in stages (``then:``, fgrpo.core.stages): how a stage is laid over the one before, every
problem of every stage at once, and ``fgrpo compose`` training the stages in turn, each from the
policy the one before ended with, resumed bit-exactly wherever it stopped."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
import yaml
from safetensors.torch import load_file

from _helpers import crash_after
from fgrpo.core import cli, stages
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.config import RecipeError
from fgrpo.core.runlog import read_metrics
from fgrpo.worlds.driving.planner import TrajectoryPolicy

#: a tiny driving recipe: DiffusionNFT, then Flow-GRPO with a KL to the first stage's planner
TINY = {
    "seed": 3,
    "model": {"name": "trajectory"},
    "sampler": {"name": "ode", "steps": 2},
    "reward": {"name": "driving-rollout", "execute": 1.0, "seconds": 2.0},
    "objective": {"name": "nft", "kl_beta": 0.01},
    "prompts": {"name": "driving", "train_seeds": 3, "test_seeds": 1, "times": [0], "closed_loop": None},
    "train": {"iterations": 3, "prompts_per_iteration": 2, "group_size": 2, "checkpoint_every": 1},
    "eval": {"every": 0},
    "log": {"plots": False},
    "then": [
        {
            "sampler": {"name": "full", "steps": 2, "kernel": {"name": "sde", "eta": 0.5}},
            "objective": {"name": "grpo", "clip_range": 0.2, "kl_beta": 0.1},
            # every sample in the update, as in the rollout's batch: the first ratio is then exactly 1
            "train": {"iterations": 4, "lr": 2.0e-4, "drop_zero_advantage": False},
        }
    ],
}


def write(tmp_path, data, name="staged.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def compose(recipe, out, *more):
    return cli.main(["compose", recipe, "--out", str(out), "--quiet", *more])


def final_weights(out):
    return load_file(str(out / "checkpoints" / "last" / "trainable.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- laying a stage over the one before ----------------------------------------------------------


def test_a_stage_merges_mappings_and_replaces_other_components_lists_and_values():
    before = {
        "objective": {"name": "nft", "kl_beta": 0.01, "nft_beta": 1.0},
        "train": {"iterations": 900, "lr": 1e-4, "group_size": 8},
        "prompts": {"name": "driving", "randomize": {"headway": [1.0, 2.0], "fraction": 0.5}},
        "evaluator": ["driving-closed-loop", {"name": "driving-highway", "every": 0}],
    }
    stage = {
        "objective": {"name": "grpo", "clip_range": 0.01},
        "train": {"iterations": 300},
        "prompts": {"randomize": {"fraction": 1.0}},
        "evaluator": ["driving-closed-loop"],
    }
    kept = yaml.safe_dump(before), yaml.safe_dump(stage)
    assert stages.merged(before, stage) == {
        "objective": {"name": "grpo", "clip_range": 0.01},  # another component: nft's keys would not fit
        "train": {"iterations": 300, "lr": 1e-4, "group_size": 8},
        "prompts": {"name": "driving", "randomize": {"headway": [1.0, 2.0], "fraction": 1.0}},
        "evaluator": ["driving-closed-loop"],
    }
    assert (yaml.safe_dump(before), yaml.safe_dump(stage)) == kept
    # the same component named again merges
    assert stages.merged(before, {"objective": {"name": "nft", "kl_beta": 0.1}})["objective"] == {
        "name": "nft",
        "kl_beta": 0.1,
        "nft_beta": 1.0,
    }


def test_each_stage_is_validated_whole_and_laid_over_the_stage_before():
    data = {**TINY, "then": [*TINY["then"], {"train": {"iterations": 2}}]}
    recipe = recipe_mod.from_dict(data)
    assert "then" not in recipe.data and recipe.train.iterations == 3
    second, third = recipe.later
    assert (second.data["objective"]["name"], second.train.iterations, second.train.lr) == ("grpo", 4, 2.0e-4)
    # the third stage changes only the iterations of the second
    assert (third.data["objective"]["name"], third.train.iterations, third.train.lr) == ("grpo", 2, 2.0e-4)
    assert second.data["prompts"] == recipe.data["prompts"] and second.seed == recipe.seed == 3
    # --set reaches into a stage as into any list
    shrunk = recipe_mod.from_dict(data, ["then.0.train.iterations=1"])
    assert shrunk.later[0].train.iterations == 1


def test_every_problem_of_every_stage_is_one_line_named_under_its_stage(tmp_path, capsys):
    data = {
        **TINY,
        "train": {**TINY["train"], "group_size": 1},  # the first stage's problem, reported once
        "then": [
            {"train": {"lr": -1.0}, "objective": {"name": "grpo", "clip_range": "wide"}},
            {"model": {"path": "mine.safetensors"}, "then": [{}]},
        ],
    }
    assert cli.main(["validate", write(tmp_path, data)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln.removeprefix("error: ") for ln in err.strip().splitlines()]
    assert sum("group_size" in ln for ln in lines) == 1, err
    assert any(ln.startswith("then.0.train.lr:") and "-1.0" in ln for ln in lines), err
    assert any(ln.startswith("then.0.objective.clip_range:") and "wide" in ln for ln in lines), err
    assert any(ln.startswith("then.1.then:") and "do not nest" in ln for ln in lines), err
    data["then"][1].pop("then")
    data["train"]["group_size"] = 2
    data["then"][0] = TINY["then"][0]
    assert cli.main(["validate", write(tmp_path, data)]) == 2
    err = capsys.readouterr().err
    assert "then.1.model.path: is set by the stage before (its exported weights); leave it out" in err, err


@pytest.mark.parametrize(
    ("then", "key"), [([], "then"), ({"train": {"iterations": 2}}, "then"), (["train.iterations=2"], "then.0")]
)
def test_then_that_is_not_a_list_of_mappings_is_refused(then, key):
    with pytest.raises(RecipeError) as raised:
        recipe_mod.from_dict({**TINY, "then": then})
    assert [e.key for e in raised.value.errors] == [key]


def test_a_model_that_cannot_start_from_an_export_is_refused_at_validation(root):
    data = yaml.safe_load((root / "recipes" / "shapes.yaml").read_text())
    data["then"] = [{"train": {"iterations": 2}}]
    with pytest.raises(RecipeError) as raised:
        recipe_mod.from_dict(data)
    (error,) = raised.value.errors
    assert error.key == "then.0.model.name" and "shapes-dit" in error.message and "start_from" in error.message


def test_validate_and_dry_run_show_every_stage(root, capsys):
    assert cli.main(["validate", str(root / "recipes" / "driving.yaml")]) == 0
    assert "900 + 300 iterations in 2 stages" in capsys.readouterr().out
    assert cli.main(["compose", str(root / "recipes" / "driving.yaml"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "then stage 2 of 2, from stage 1's policy" in text and "grpo" in text and "nft" in text


# --- training the stages ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The tiny recipe trained without a stop."""
    tmp = tmp_path_factory.mktemp("straight")
    out = tmp / "run"
    assert compose(write(tmp, TINY), out) == 0
    return out


def test_the_last_stage_trains_in_the_run_folder_from_the_export_of_the_stage_before(straight):
    first = straight / "stages" / "1"
    assert (first / "checkpoints" / "last").is_dir() and [r["iteration"] for r in read_metrics(first)] == [1, 2, 3]
    export = first / "export" / "iter_000003" / "trajectory.safetensors"  # named after the checkpoint it is
    resolved = yaml.safe_load((straight / "recipe.resolved.yaml").read_text())
    assert resolved["model"]["path"] == str(export) and resolved["objective"]["name"] == "grpo"
    assert [r["iteration"] for r in read_metrics(straight)] == [1, 2, 3, 4]
    # the export is stage 1's last weights, and stage 2 started from them: its first update is on-policy
    # against a reference that is its own policy, so the ratio is exactly 1 and the KL exactly 0
    trained = TrajectoryPolicy()
    trained.load_trainable_state_dict(load_file(str(first / "checkpoints" / "last" / "trainable.safetensors")))
    started = TrajectoryPolicy(path=str(export))
    for a, b in zip(trained.network.state_dict().values(), started.network.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # the last stage's report links the one before
    assert 'href="stages/1/report.html"' in (straight / "report.html").read_text()
    assert "stages before it" not in (first / "report.html").read_text()
    row = read_metrics(straight)[0]
    assert row["first_ratio_deviation"] == 0.0 and row["kl"] == 0.0, row


@pytest.mark.parametrize("crash_at", [2, 4], ids=["in-stage-1", "in-stage-2"])
def test_a_stop_in_any_stage_resumes_bit_exactly(tmp_path, straight, capsys, crash_at):
    recipe, out = write(tmp_path, TINY), tmp_path / "run"
    with crash_after(crash_at):  # stage 1 has 3 iterations: 4 is reached in stage 2 only
        assert compose(recipe, out) == 130
    assert compose(recipe, out) == 2  # a new run may not start over what is there
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert compose(recipe, out, "--resume") == 0
    said = capsys.readouterr().out
    assert ("stage 1 of 2: trained already" in said) == (crash_at == 4), said
    assert_same_weights(final_weights(out), final_weights(straight))
    keys = ("reward_mean", "loss", "kl")
    assert [[r.get(k) for k in keys] for r in read_metrics(out)] == [
        [r.get(k) for k in keys] for r in read_metrics(straight)
    ]


def test_resuming_a_stage_that_ended_under_another_recipe_is_refused(tmp_path, straight, capsys):
    out = tmp_path / "run"
    (out / "stages").mkdir(parents=True)
    shutil.copytree(straight / "stages" / "1", out / "stages" / "1", symlinks=True)
    (out / "stages" / "1" / ".fgrpo.lock").unlink(missing_ok=True)
    assert compose(write(tmp_path, TINY), out, "--resume", "--set", "objective.kl_beta=0.5") == 2
    err = capsys.readouterr().err
    assert "--resume: the recipe differs from" in err and "objective.kl_beta" in err, err
    assert not (out / "checkpoints").exists()


def test_an_export_lost_between_stages_is_written_again_the_same(tmp_path, straight):
    out = tmp_path / "run"
    (out / "stages").mkdir(parents=True)
    first = out / "stages" / "1"
    shutil.copytree(straight / "stages" / "1", first, symlinks=True)
    shutil.rmtree(first / "export")
    (first / ".fgrpo.lock").unlink(missing_ok=True)
    assert compose(write(tmp_path, TINY), out, "--resume") == 0
    assert_same_weights(final_weights(out), final_weights(straight))


def test_overrides_for_every_stage_repeat_where_a_stage_sets_the_section():
    written = {"train": {"iterations": 900}, "then": [{"train": {"iterations": 300}, "objective": {"name": "grpo"}}]}
    assert stages.for_every_stage(written, ["train.iterations=1", "seed=2", "objective.kl_beta=0.5"]) == [
        "train.iterations=1",
        "seed=2",
        "objective.kl_beta=0.5",
        "then.0.train.iterations=1",
        "then.0.objective.kl_beta=0.5",
    ]
    assert stages.for_every_stage({"train": {}}, ["train.lr=1"]) == ["train.lr=1"]


def test_later_stages_reuse_the_highway_env_starts_driven_for_the_first_and_train_the_same(tmp_path, monkeypatch):
    """The starts read from highway-env's episodes (prompts.highway) are driven once per process:
    the second stage takes them from the first's, and trains exactly as when it drives them anew."""
    pytest.importorskip("highway_env")
    import fgrpo.worlds.driving.highway_starts as highway_starts

    starts = {"episodes": 1, "seed": 0, "seconds": 5.0, "configs": [{"lanes": 3}]}
    data = {**TINY, "prompts": {**TINY["prompts"], "highway": starts}}
    recipe = write(tmp_path, data)
    highway_starts.driven_starts.cache_clear()
    assert compose(recipe, tmp_path / "kept") == 0
    assert highway_starts.driven_starts.cache_info().hits >= 1
    monkeypatch.setattr(highway_starts, "driven_starts", highway_starts.driven_starts.__wrapped__)
    assert compose(recipe, tmp_path / "anew") == 0
    assert_same_weights(final_weights(tmp_path / "kept"), final_weights(tmp_path / "anew"))


@pytest.mark.multiprocess
def test_two_processes_train_the_stages_in_turn_into_one_folder(tmp_path):
    """torchrun, 2 CPU processes (gloo): the main process exports stage 1 and the other waits for
    it at the next stage's start; both stages end in one folder, as in one process."""
    from _helpers import torchrun

    recipe, out = write(tmp_path, TINY), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [*torchrun(), "-m", "fgrpo.core.cli", "compose", recipe, "--out", str(out), "--quiet"]
    done = subprocess.run(command, env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert [r["iteration"] for r in read_metrics(out / "stages" / "1")] == [1, 2, 3]
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert (out / "stages" / "1" / "export" / "iter_000003" / "trajectory.safetensors").is_file()
    # without --out, two processes could not agree on a new folder
    alone = command[: command.index("--out")] + ["--quiet"]
    done = subprocess.run(alone, env=env, timeout=300, capture_output=True, text=True, cwd=tmp_path)
    # each process exits 2 with the line; torchrun itself reports a failed launch with 1
    assert done.returncode == 1 and "--out: a recipe in stages launched on several processes needs" in done.stderr
    assert any(line.startswith("error: --out: a recipe in stages") for line in done.stderr.splitlines())


def test_a_stage_trained_on_gets_a_new_export_and_the_next_stage_is_not_resumed_from_another_start(
    tmp_path, straight, capsys
):
    """Raising stage 1's iterations on --resume trains it on and exports its new last checkpoint
    beside the old export (never the stale one); stage 2, trained from the old start, then refuses
    to resume, naming model.path."""
    out = tmp_path / "run"
    shutil.copytree(straight, out, symlinks=True)
    for lock in out.rglob(".fgrpo.lock"):
        lock.unlink()
    assert compose(write(tmp_path, TINY), out, "--resume", "--set", "train.iterations=4") == 2
    err = capsys.readouterr().err
    assert "--resume: the recipe differs from the checkpoint's" in err and "model.path" in err, err
    exports = sorted(p.name for p in (out / "stages" / "1" / "export").iterdir())
    assert exports == ["iter_000003", "iter_000004"]
