"""Experiment trackers through accelerate: a tracker passed to the Accelerator's ``log_with``
receives the resolved recipe as config, every iteration's scalars and each evaluation's sample
grid; TensorBoard gets the same; wandb is optional and never reaches the network here."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
from accelerate import tracking
from accelerate.tracking import GeneralTracker
from accelerate.utils import LoggerType
from rich.console import Console

from fgrpo.core import cli
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.opening import open_run
from fgrpo.core.runlog import read_metrics
from fgrpo.core.trainer import train

QUIET = Console(quiet=True)
SMALL_SHAPES = [
    "train.iterations=2",
    "train.prompts_per_iteration=2",
    "eval.every=2",
    "eval.max_prompts=6",
    "eval.samples_per_prompt=2",
    "log.project=my-project",
]


class FakeTracker(GeneralTracker):
    """A custom tracker the way accelerate lets you write one (an instance in ``log_with``)."""

    name = "fake"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.started = self.finished = False
        self.config: dict | None = None
        self.scalars: dict[int, dict] = {}
        self.images: dict[int, dict] = {}

    @property
    def tracker(self):
        return self

    def start(self):
        self.started = True

    def store_init_configuration(self, values):
        self.config = dict(values)

    def log(self, values, step=None, **kwargs):
        self.scalars.setdefault(step, {}).update(values)

    def log_images(self, values, step=None, **kwargs):
        self.images[step] = {k: np.asarray(v) for k, v in values.items()}

    def finish(self):
        self.finished = True


def test_a_tracker_receives_config_scalars_and_sample_grids(root, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)  # mlflow's own default store is ./mlflow.db
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = recipe_mod.load(root / "recipes" / "shapes.yaml", [*SMALL_SHAPES, "log.trackers=[tensorboard, mlflow]"])
    fake = FakeTracker()
    out = tmp_path / "run"
    run = open_run(recipe, out=str(out), resume=False, console=QUIET, quiet=True, extra_trackers=[fake])
    with run.io.display:
        train(run)
    assert fake.started and fake.finished
    config = fake.config
    assert config["model.name"] == "shapes-dit" and config["model.lora.rank"] == 32
    assert config["sampler.kernel.name"] == "cps" and config["reward.0.name"] == "shapes"
    assert config["train.iterations"] == 2 and config["log.trackers.0"] == "tensorboard"
    assert config["run_dir"] == str(out)
    assert all(isinstance(v, (int, float, str, bool)) for v in config.values())
    rows = read_metrics(out)
    assert sorted(fake.scalars) == [r["iteration"] for r in rows] == [0, 1, 2]
    for row in rows:  # every numeric metric of metrics.jsonl, at its iteration
        expected = {k: v for k, v in row.items() if k != "iteration" and isinstance(v, (int, float))}
        assert fake.scalars[row["iteration"]] == expected
    assert "eval/shapes/accuracy" in fake.scalars[0] and "reward_mean" in fake.scalars[1]
    assert sorted(fake.images) == [0, 2]  # one sample grid per evaluation
    grid = fake.images[2]["eval/samples"]
    assert grid.dtype == np.uint8 and grid.ndim == 4 and grid.shape[0] == 1 and grid.shape[-1] == 3
    from PIL import Image

    assert np.array_equal(grid[0], np.asarray(Image.open(out / "samples" / "eval_000002.png").convert("RGB")))

    # TensorBoard, started the same way, holds the same scalars, the grids and the config
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2]
    assert [e.step for e in events.Images("eval/samples")] == [0, 2]
    assert [p.name for p in (out / "tensorboard").iterdir() if p.is_dir()] == []  # one run, not three
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["model.name"].string_value == "shapes-dit" and hparams["train.iterations"].number_value == 2

    # mlflow: its store in the run folder, the run named after it, the config, the metrics and the grids
    assert not (tmp_path / "mlflow.db").exists() and (out / "mlflow" / "mlflow.db").is_file()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow' / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "my-project"]
    (logged,) = client.search_runs([experiment.experiment_id])
    assert logged.info.run_name == "run" and logged.data.params["model.name"] == "shapes-dit"
    assert len(logged.data.params) == len(config)
    assert [m.step for m in client.get_metric_history(logged.info.run_id, "reward_mean")] == [1, 2]
    assert [a.path for a in client.list_artifacts(logged.info.run_id, "eval/samples")] == [
        "eval/samples/iteration_000000.png",
        "eval/samples/iteration_000002.png",
    ]
    stored = Path(client.download_artifacts(logged.info.run_id, "eval/samples/iteration_000002.png", str(tmp_path)))
    assert np.array_equal(np.asarray(Image.open(stored).convert("RGB")), grid[0])
    assert str(out / "mlflow" / "artifacts") in experiment.artifact_location


def test_mlflow_resumes_its_run_and_takes_another_store(root, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    team = f"sqlite:///{tmp_path / 'team.db'}"
    base = [
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(tmp_path / "run"),
        "--quiet",
        "--set",
        "log.trackers=[mlflow]",
        "--set",
        f"log.init_kwargs={{mlflow: {{tracking_uri: '{team}', tags: {{team: vision}}}}}}",
        "--set",
        "eval.every=0",
    ]
    assert cli.main([*base, "--set", "train.iterations=1"]) == 0
    assert cli.main([*base, "--set", "train.iterations=2", "--resume"]) == 0
    assert not (tmp_path / "run" / "mlflow").exists() and not (tmp_path / "mlflow.db").exists()
    client = mlflow.MlflowClient(tracking_uri=team)
    (logged,) = client.search_runs([client.get_experiment_by_name("fgrpo").experiment_id])
    assert logged.info.run_name == "run" and logged.data.tags["team"] == "vision"
    assert [m.step for m in client.get_metric_history(logged.info.run_id, "reward_mean")] == [1, 2]


def test_no_trackers_writes_no_events(root, tmp_path):
    out = tmp_path / "run"
    assert cli.main([*_one_iteration(root, out), "--set", "log.trackers=[]"]) == 0
    assert not (out / "tensorboard").exists() and read_metrics(out)


def test_wandb_chosen_but_not_installed_is_a_recipe_error(root, monkeypatch, capsys):
    monkeypatch.setattr(
        tracking, "_available_trackers", [t for t in tracking._available_trackers if t != LoggerType.WANDB]
    )
    code = cli.main(
        ["validate", str(root / "recipes" / "vector.yaml"), "--set", "log.trackers=[tensorboard, wandb, mlfow]"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "log.trackers: got ['tensorboard', 'wandb', 'mlfow']: " in err
    assert "wandb is not installed: pip install wandb" in err
    assert "unknown tracker 'mlfow' (accelerate knows: " in err
    assert "Traceback" not in err


def test_wandb_gets_project_run_name_folder_and_options(root, tmp_path, monkeypatch):
    """accelerate's own WandBTracker over a stand-in wandb module: what fgrpo passes reaches
    wandb.init; nothing is sent anywhere."""
    calls: dict = {"logs": []}
    fake = types.ModuleType("wandb")

    class FakeRun:
        def log(self, values, step=None, **kwargs):
            calls["logs"].append((step, values))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    fake.init = init
    fake.config = types.SimpleNamespace(
        update=lambda values, allow_val_change: calls.setdefault("config", dict(values))
    )
    fake.Image = lambda image: ("image", np.asarray(image).shape)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(tracking, "_available_trackers", [*tracking._available_trackers, LoggerType.WANDB])
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "compose",
                str(root / "recipes" / "vector.yaml"),
                "--out",
                str(out),
                "--quiet",
                "--set",
                "train.iterations=2",
                "--set",
                "log.trackers=[wandb]",
                "--set",
                "log.project=fgrpo-tests",
                "--set",
                "log.init_kwargs={wandb: {mode: offline, tags: [ci]}}",
            ]
        )
        == 0
    )
    assert calls["init"] == {
        "project": "fgrpo-tests",
        "name": "run",
        "dir": str(out),
        "mode": "offline",
        "tags": ["ci"],
    }
    assert calls["config"]["train.iterations"] == 2
    assert [step for step, _ in calls["logs"]] == [0, 1, 2] and "reward_mean" in calls["logs"][1][1]
    assert calls["finished"]


def test_tracker_options_must_be_mappings(root, capsys):
    assert cli.main(["validate", str(root / "recipes" / "vector.yaml"), "--set", "log.init_kwargs={wandb: 3}"]) == 2
    assert (
        "log.init_kwargs: got {'wandb': 3}; expected a mapping of options per tracker (not for wandb)"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize("change", ["log.trackers=[]", "log.project=other"])
def test_changing_trackers_on_resume_is_allowed(root, tmp_path, change):
    base = [
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(tmp_path),
        "--quiet",
        "--set",
        "train.iterations=1",
    ]
    assert cli.main(base) == 0
    assert cli.main(base + ["--resume", "--set", "train.iterations=2", "--set", change]) == 0


# --- issue 22: tracker options are checked at `validate` against the tracker's own signature ------


def test_bad_tracker_options_on_resume_write_nothing(root, tmp_path, capsys):
    import hashlib

    recipe = str(root / "recipes" / "vector.yaml")
    base = [
        "compose",
        recipe,
        "--out",
        str(tmp_path),
        "--quiet",
        "--set",
        "train.iterations=1",
        "--set",
        "eval.every=0",
    ]
    assert cli.main(base) == 0
    before = {
        p: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in tmp_path.rglob("*")
        if p.is_file() and p.name != ".fgrpo.lock"
    }
    # before: a TypeError traceback after recipe.resolved.yaml was rewritten with the bad options
    assert (
        cli.main(
            base
            + ["--resume", "--set", "train.iterations=2", "--set", "log.init_kwargs={tensorboard: {logging_dir: x}}"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "error: log.init_kwargs.tensorboard.logging_dir: fgrpo sets it" in err and "Traceback" not in err
    after = {
        p: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in tmp_path.rglob("*")
        if p.is_file() and p.name != ".fgrpo.lock"
    }
    assert after == before


def test_good_tracker_options_reach_the_tracker(root, tmp_path, monkeypatch):
    from torch.utils import tensorboard

    seen = []
    real = tensorboard.SummaryWriter.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(tensorboard.SummaryWriter, "__init__", spy)
    assert (
        cli.main(
            [
                "compose",
                str(root / "recipes" / "vector.yaml"),
                "--out",
                str(tmp_path / "run"),
                "--quiet",
                "--set",
                "train.iterations=1",
                "--set",
                "eval.every=0",
                "--set",
                "log.init_kwargs={tensorboard: {flush_secs: 7, filename_suffix: .mine}}",
            ]
        )
        == 0
    )
    assert seen[0] == {"purge_step": 0, "flush_secs": 7, "filename_suffix": ".mine"}  # the run's writer


def test_options_are_checked_against_the_libraries_own_signature(root, monkeypatch, capsys):
    fake = types.ModuleType("wandb")

    def init(project=None, name=None, dir=None, mode=None, tags=None, entity=None):
        raise AssertionError("validate must not start wandb")

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(tracking, "_available_trackers", [*tracking._available_trackers, LoggerType.WANDB])
    recipe = str(root / "recipes" / "vector.yaml")
    good = cli.main(
        [
            "validate",
            recipe,
            "--set",
            "log.trackers=[wandb]",
            "--set",
            "log.init_kwargs={wandb: {mode: offline, tags: [a]}}",
        ]
    )
    assert good == 0
    bad = cli.main(
        [
            "validate",
            recipe,
            "--set",
            "log.trackers=[wandb]",
            "--set",
            "log.init_kwargs={wandb: {mood: offline, project: p}}",
        ]
    )
    assert bad == 2
    err = capsys.readouterr().err
    assert (
        "log.init_kwargs.wandb.mood: unknown option of the wandb tracker (did you mean 'mode'?); allowed: dir, "
        "entity, mode, name, tags" in err
    )
    assert "log.init_kwargs.wandb.project: fgrpo sets it (log.project); remove it" in err


def test_tracker_options_of_the_wrong_kind_are_refused_at_validate(root, tmp_path, capsys):
    """Before: flush_secs 'abc' reached TensorBoard's writer thread at start, which printed a
    thread traceback, and the new folder was left with its lock and tensorboard/ (issue 50, M3)."""
    out = tmp_path / "run"
    bad = "log.init_kwargs={tensorboard: {flush_secs: abc, max_queue: 2.5, comment: 3}}"
    code = cli.main(["compose", str(root / "recipes" / "vector.yaml"), "--out", str(out), "--set", bad])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err + captured.out
    assert [line for line in captured.err.splitlines() if line.startswith("error: ")] == [
        "error: log.init_kwargs.tensorboard.flush_secs: got 'abc'; allowed: an integer",
        "error: log.init_kwargs.tensorboard.max_queue: got 2.5; allowed: an integer",
        "error: log.init_kwargs.tensorboard.comment: got 3; allowed: a string",
    ]
    assert not out.exists()


def _one_iteration(root: Path, out: Path) -> list[str]:
    return [
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(out),
        "--quiet",
        "--set",
        "train.iterations=1",
    ]


def _fail_to_start(out_dir: Path) -> None:
    """What a tracker whose library fails at start leaves: its folder, half written."""
    (out_dir / "tensorboard").mkdir()
    (out_dir / "tensorboard" / "events.partial").write_bytes(b"x")
    raise OSError(28, "No space left on device")


def test_a_tracker_that_fails_at_start_leaves_no_folder_and_the_command_runs_again(
    root, tmp_path, monkeypatch, capsys
):
    """A tracker its library refuses at start (a full disk, a server): one line, and the new folder
    is gone, so the same command runs again (before: "already holds a run")."""
    from fgrpo.core import trackers

    real = trackers.start
    monkeypatch.setattr(trackers, "start", lambda accelerator, recipe, out_dir, **_: _fail_to_start(out_dir))
    out = tmp_path / "run"
    args = _one_iteration(root, out)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "error: log.trackers: a tracker could not start: OSError" in err and "Traceback" not in err
    assert not out.exists()
    monkeypatch.setattr(trackers, "start", real)
    assert cli.main(args) == 0


def test_a_tracker_failing_in_a_folder_that_held_files_leaves_them(root, tmp_path, monkeypatch):
    """Only what the failed start added goes: files the folder held before it are kept."""
    from fgrpo.core import trackers

    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setattr(trackers, "start", lambda accelerator, recipe, out_dir, **_: _fail_to_start(out_dir))
    args = _one_iteration(root, out)
    assert cli.main(args) == 2
    assert out.is_dir() and list(out.iterdir()) == []


def test_mlflow_with_an_unreachable_server_gives_up_within_its_deadline(root, tmp_path, capsys, monkeypatch):
    """Before: 255 s of silence (mlflow's 7 retries with backoff and a 120 s timeout each), then one
    line. A server that does not answer costs at most log.timeout_s per call (issue 50, M4)."""
    import time

    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    args = [
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(tmp_path / "run"),
        "--quiet",
        "--set",
        "log.trackers=[mlflow]",
        "--set",
        "log.timeout_s=3",
        "--set",
        "log.init_kwargs={mlflow: {tracking_uri: 'http://10.255.255.1:5000'}}",
    ]
    start = time.monotonic()
    assert cli.main(args) == 2
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert "error: log.trackers: a tracker could not start" in err and "Traceback" not in err
    assert elapsed < 30, f"{elapsed:.0f} s"
    assert not (tmp_path / "run").exists()


def test_mlflow_writes_nothing_outside_the_run_folder(root, tmp_path):
    """mlflow's telemetry wrote ~/.config/mlflow/telemetry.json (issue 50, LOW): fgrpo turns it off.
    (A process of its own: mlflow writes it from a thread of the process that imported it.)"""
    import os
    import subprocess

    pytest.importorskip("mlflow")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CONFIG_HOME", "MLFLOW_TRACKING_URI", "DO_NOT_TRACK")}
    env.update(HOME=str(home), MPLCONFIGDIR=str(tmp_path / "mpl"), OMP_NUM_THREADS="1")
    args = ["compose", str(root / "recipes" / "vector.yaml"), "--out", str(tmp_path / "run"), "--quiet"]
    args += ["--set", "log.trackers=[mlflow]", "--set", "train.iterations=1", "--set", "eval.every=0"]
    done = subprocess.run([sys.executable, "-m", "fgrpo.core.cli", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [str(p.relative_to(home)) for p in home.rglob("*") if "mlflow" in str(p)] == []
