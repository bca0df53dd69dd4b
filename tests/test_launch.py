"""A bad recipe under accelerate is one message and exit code 2: ``fgrpo launch`` checks the recipe
before any process starts, and a recipe error found in the processes is printed by the main
process only and comes back as exit code 2, without the launcher's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import free_port
from fgrpo.core import cli

BIN = Path(sys.executable).parent


def test_launch_checks_the_recipe_before_starting_processes(root, tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: started.append(args))
    bad = [
        "launch",
        "--cpu",
        "--num_processes",
        "1",
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--set",
        "train.lr=-1",
    ]
    assert cli.main(bad) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.splitlines()[0], "1 error(s); nothing was run."]
    assert err.startswith("error: train.lr: ") and "Traceback" not in err and started == []

    with pytest.raises(SystemExit) as exited:  # compose without its recipe: argparse's one line, as without launch
        cli.main(["launch", "--cpu", "compose"])
    assert exited.value.code == 2
    assert "the following arguments are required: recipe" in capsys.readouterr().err
    assert cli.main(["launch", "--cpu", "--num_processes", "1"]) == 2
    assert "expected accelerate launch options, then compose or check or sample" in capsys.readouterr().err

    good = [
        "launch",
        "--cpu",
        "--num_processes",
        "1",
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(tmp_path / "r"),
    ]
    assert cli.main(good) == 0
    (args,) = started
    assert args.module and args.training_script == "fgrpo.core.cli" and args.num_processes == 1
    assert args.training_script_args == good[4:]


def test_a_config_file_that_is_neither_a_file_nor_shipped_is_one_line(root, tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr("accelerate.commands.launch.launch_command", lambda args: started.append(args))
    monkeypatch.chdir(tmp_path)
    recipe = str(root / "recipes" / "vector.yaml")
    shipped = (
        "cpu, ddp, deepspeed-zero2, deepspeed-zero2-offload, deepspeed-zero3, deepspeed-zero3-offload, fsdp-full, "
    )
    shipped += "fsdp-lora, multi-node"
    allowed = f"allowed: an accelerate config file, or a shipped config: {shipped}"
    cases = [
        (["--config_file", "nosuch"], f"--config_file: got 'nosuch' (no such file); {allowed}"),
        (["--config_file=dpp"], f"--config_file: got 'dpp' (no such file; did you mean 'ddp'?); {allowed}"),
        (["--config_file"], f"--config_file: got nothing; {allowed}"),
        (["--config_file="], f"--config_file: got '' (empty); {allowed}"),
        (["--config_file", "configs/ddp.yaml"], f"--config_file: got 'configs/ddp.yaml' (no such file); {allowed}"),
        (["--config_file", str(tmp_path)], f"--config_file: got {str(tmp_path)!r} (a folder); {allowed}"),
    ]
    for options, line in cases:
        assert cli.main(["launch", *options, "compose", recipe]) == 2, options
        captured = capsys.readouterr()
        assert captured.err.splitlines() == [f"error: {line}", "1 error(s); nothing was run."]
        assert "Traceback" not in captured.err and captured.out == ""
    # with a bad recipe as well: both at once
    assert cli.main(["launch", "--config_file", "nosuch", "compose", recipe, "--set", "train.lr=-1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"error: --config_file: got 'nosuch' (no such file); {allowed}"
    assert err[1].startswith("error: train.lr: ") and err[2:] == ["2 error(s); nothing was run."]
    assert started == []


def test_a_missing_config_file_through_the_command_line_is_one_line(root, tmp_path):
    """The same line from the installed command, with accelerate's real launcher behind it."""
    result = subprocess.run(
        [str(BIN / "fgrpo"), "launch", "--config_file", "nosuch", "compose", str(root / "recipes" / "vector.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0].startswith("error: --config_file: got 'nosuch' (no such file); allowed: ")
    assert result.stderr.splitlines()[1:] == ["1 error(s); nothing was run."]


def test_only_the_main_process_prints_a_recipe_error(root, capsys, monkeypatch):
    bad = ["validate", str(root / "recipes" / "vector.yaml"), "--set", "train.lr=-1"]
    monkeypatch.setenv("RANK", "1")
    assert cli.main(bad) == 2
    assert capsys.readouterr().err == ""
    assert cli.main(["--log-level", "debug", *bad]) == 2  # every process says it, marked
    assert capsys.readouterr().err.startswith("process 1: error: train.lr: ")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(bad) == 2
    assert capsys.readouterr().err.startswith("error: train.lr: ")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_error_found_in_two_processes_is_one_message_and_exit_code_2(root, tmp_path):
    """2 data-parallel processes on the CPU, 3 prompts per iteration: valid as a recipe, refused by
    each process (not a multiple of 2). About 10 s of CPU per launch."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [
        "compose",
        str(root / "recipes" / "vector.yaml"),
        "--out",
        str(tmp_path / "run"),
        "--set",
        "train.prompts_per_iteration=3",
        "--set",
        "train.group_size=2",
    ]
    flags = [
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    line = "error: train.prompts_per_iteration: got 3; must be a multiple of the 2 processes"

    ours = subprocess.run(
        [str(BIN / "fgrpo"), "launch", *flags, "--main_process_port", str(free_port()), *command],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert ours.returncode == 2
    assert ours.stderr.splitlines() == [line, "1 error(s); nothing was run."] and ours.stdout == ""

    # plain accelerate launch: the error once too; accelerate itself then fails with exit 1 and its traceback
    theirs = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            *flags,
            "--main_process_port",
            str(free_port()),
            "-m",
            "fgrpo.core.cli",
            *command,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert theirs.returncode == 1
    assert theirs.stderr.count(line) == 1
