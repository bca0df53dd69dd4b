"""Ctrl-C and SIGTERM keep the work (issue "Interrupts keep work"): real signals sent to a running
``fgrpo compose`` let the iteration in progress finish, checkpoint it, write report.html, print the
command that goes on, and exit 130 / 143; going on from there trains exactly what an uninterrupted
run trains. A second Ctrl-C stops at once, keeping the last complete checkpoint."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from _helpers import ROOT, assert_same_training, free_port

BIN = Path(sys.executable).parent
RECIPE = str(ROOT / "recipes" / "vector.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TOTAL = 40
SETS = [
    *("--set", f"train.iterations={TOTAL}"),
    *("--set", "train.checkpoint_every=25"),  # the stop falls between two periodic checkpoints (or on one)
    *("--set", "eval.every=10"),
    *("--set", "log.plots=false"),
]
LINE = re.compile(r"interrupted after iteration (\d+): checkpoint (\S+); report (\S+); go on with: (.+)")
#: vector.yaml with ~3 s iterations: a signal surely lands in the middle of one
#: iterations long enough that two presses 0.7 s apart land in the same one on an idle machine too
#: (3000 steps: about 1 s an iteration on 2 idle cores, and the second press came after it ended)
SLOW = ["--set", "sampler.steps=8000", "--set", "eval.every=0", "--set", "log.plots=false"]


def compose(out: Path, sets: list[str], launcher: list[str] | None = None) -> subprocess.Popen:
    """``fgrpo [launch ...] compose`` in a session of its own: killpg reaches all its processes, as a
    terminal's Ctrl-C reaches its foreground group."""
    return subprocess.Popen(
        [str(BIN / "fgrpo"), *(launcher or []), "compose", RECIPE, "--out", str(out), *sets, "--quiet"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_rows(proc: subprocess.Popen, out: Path, rows: int) -> None:
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= rows):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.005)


def finished(proc: subprocess.Popen) -> tuple[str, float]:
    """stdout + stderr of ``proc`` and the seconds it took to end from now."""
    t0 = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return stdout + stderr, time.monotonic() - t0


def go_on(command: str) -> None:
    """Run the command the interrupted run printed, as printed (with this installation's fgrpo)."""
    words = shlex.split(command)
    assert words[0] == "fgrpo" and "--resume" in words
    done = subprocess.run(
        [str(BIN / "fgrpo"), *words[1:]], env=ENV, capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]


def check_stop(text: str, out: Path, total: int = TOTAL) -> tuple[int, str]:
    """The one line an interrupted run prints, and what it names: the checkpoint of the last
    iteration (the last row of metrics.jsonl) and report.html. Returns (iteration, command)."""
    lines = [line for line in text.splitlines() if "go on with:" in line]
    assert len(lines) == 1, text[-3000:]
    found = LINE.fullmatch(lines[0])
    assert found is not None, lines[0]
    iteration, checkpoint, report, command = int(found[1]), Path(found[2]), Path(found[3]), found[4]
    assert 0 < iteration < total
    assert checkpoint == out / "checkpoints" / f"iter_{iteration:06d}"
    assert json.loads((checkpoint / "state.json").read_text())["iteration"] == iteration
    assert (out / "checkpoints" / "last").resolve() == checkpoint.resolve()
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["iteration"] == iteration
    assert report == out / "report.html" and report.is_file()
    return iteration, command


def test_the_handlers_ask_then_stop_at_once_and_are_restored(monkeypatch):
    from fgrpo.core import interrupts

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupts.Interrupts(note=False) as caught:
        os.kill(os.getpid(), signal.SIGTERM)  # handled before os.kill returns (the main thread's own signal)
        assert caught.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # at once after: the launcher passing the same Ctrl-C on
        assert signal.getsignal(signal.SIGINT) is before[0]  # ... so the next one stops at once
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with pytest.raises(interrupts.StopNow) as stopped, interrupts.Interrupts(note=False):
        monkeypatch.setattr(interrupts, "SAME_REQUEST_S", 0.0)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # a second press
    assert stopped.value.signum == signal.SIGINT and isinstance(stopped.value, KeyboardInterrupt)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    proc = compose(out, SETS)
    text, _ = finished(proc)
    assert proc.returncode == 0, text[-3000:]
    return out


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_keeps_the_iteration_and_the_run_goes_on_exactly(reference, tmp_path, signum):
    rng = random.Random(f"{signum}-{time.time_ns()}")
    out = tmp_path / "run"
    proc = compose(out, SETS)
    wait_for_rows(proc, out, rng.randint(2, 20))  # the base evaluation's row, then one per iteration
    time.sleep(rng.uniform(0, 0.05))
    proc.send_signal(signum)
    text, seconds = finished(proc)
    assert proc.returncode == 128 + signum, text[-3000:]  # 130 / 143: what a shell reports for the signal
    iteration, command = check_stop(text, out)
    print(f"{signal.Signals(signum).name}: stopped after iteration {iteration}, {seconds:.2f} s after the signal")
    assert "--set train.iterations=40" in command  # the overrides that make the recipe the run's
    go_on(command)
    assert_same_training(reference, out)


def test_a_second_ctrl_c_stops_at_once_keeping_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = compose(out, [*SLOW, "--set", "train.iterations=50", "--set", "train.checkpoint_every=1"])
    wait_for_rows(proc, out, 1)
    time.sleep(0.5)  # into the second iteration
    proc.send_signal(signal.SIGINT)
    time.sleep(0.7)  # a second press, not the same one passed on by a launcher (interrupts.SAME_REQUEST_S)
    assert proc.poll() is None  # the first let the iteration go on
    proc.send_signal(signal.SIGINT)
    text, seconds = finished(proc)
    print(f"second SIGINT: ended {seconds:.2f} s after it")
    assert proc.returncode == 130, text[-3000:]
    assert seconds < 5  # a loaded machine's exit of a process with torch
    assert "stopping after the iteration in progress" in text and "go on with:" not in text
    assert text.rstrip().endswith("interrupted")
    last = (out / "checkpoints" / "last").resolve()
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # the second iteration, in progress, was cut short
    assert last.name == "iter_000001"  # the last iteration done, checkpointed (every 1)
    assert load_file(str(last / "trainable.safetensors"))
    assert json.loads((last / "state.json").read_text())["iteration"] == len(rows)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["group", "rank0"])
def test_two_processes_stop_after_the_same_iteration(tmp_path, target):
    """``fgrpo launch`` of 2 CPU processes (gloo). ``group``: SIGINT to every process of the launch,
    as a terminal's Ctrl-C (the launcher passes it on once more); ``rank0``: to the main process only."""
    launcher = ["launch", "--config_file", "cpu", "--main_process_port", str(free_port())]
    reference = tmp_path / "reference"
    proc = compose(reference, SETS, launcher)
    text, _ = finished(proc)
    assert proc.returncode == 0, text[-3000:]

    out = tmp_path / "run"
    proc = compose(out, SETS, launcher)
    wait_for_rows(proc, out, random.randint(2, 20))
    if target == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(_rank0(proc.pid), signal.SIGINT)
    text, seconds = finished(proc)
    assert proc.returncode == 130, text[-3000:]
    assert "(2 process(es)" in text
    iteration, command = check_stop(text, out)
    print(f"{target}: stopped after iteration {iteration}, {seconds:.2f} s after the signal")
    assert seconds < 25  # the workers ended themselves (the launcher kills them after 30 s)
    assert "lost the other processes" not in text and "Traceback" not in text, text[-3000:]
    assert command.startswith("fgrpo launch --config_file cpu --main_process_port")
    go_on(command.replace(launcher[-1], str(free_port())))
    assert_same_training(reference, out)


def _rank0(launcher: int) -> int:
    """The pid of the launch's process of RANK 0 (a descendant of the launcher's process)."""
    seen, todo = [], [launcher]
    while todo:
        pid = todo.pop()
        for task in Path(f"/proc/{pid}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
        if pid != launcher and b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return pid
        seen.append(pid)
    raise AssertionError(f"no process of rank 0 among {seen}")
