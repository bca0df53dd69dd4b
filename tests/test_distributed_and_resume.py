"""Runs that involve several processes: data parallelism on 2 CPU processes, and SIGKILL + resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _helpers import run_fgrpo, torchrun

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent
BIN = Path(sys.executable).parent


def test_two_processes_match_one(root, tmp_path):
    recipe = str(root / "recipes" / "vector.yaml")
    # one prompt group per rollout call: the noise of a group then depends only on its global slot
    sets = ["train.rollout_prompts=1", "train.prompts_per_iteration=4", "train.group_size=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one.json"
    two = tmp_path / "two.json"
    subprocess.run(
        [sys.executable, str(HERE / "dp_worker.py"), recipe, str(one), "4", *sets], check=True, env=env, timeout=300
    )
    launcher = torchrun()
    done = subprocess.run(
        [*launcher, str(HERE / "dp_worker.py"), recipe, str(two), "4", *sets],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert (a["processes"], b["processes"]) == (1, 2)
    assert all(b["identical"])  # the same weights on every rank after every step
    assert a["rewards"][0] == b["rewards"][0]  # the same samples: identical first rollout
    assert b["rewards"] == pytest.approx(a["rewards"], abs=1e-4)
    # same semantics; only the order of floating-point sums differs
    assert torch.allclose(torch.tensor(a["weights"]), torch.tensor(b["weights"]), atol=1e-5)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / "last" / "trainable.safetensors"))


def test_sigkill_at_random_moments_then_resume_is_bit_exact(root, tmp_path):
    recipe = str(root / "recipes" / "vector.yaml")
    sets = ["--set", "train.iterations=150", "--set", "train.checkpoint_every=7", "--set", "eval.every=25", "--quiet"]
    reference = tmp_path / "reference"
    done = run_fgrpo("compose", recipe, "--out", str(reference), *sets)
    assert done.returncode == 0, done.stderr

    interrupted = tmp_path / "interrupted"
    rng = random.Random(20261130)
    kills = 0
    for _attempt in range(2):
        proc = subprocess.Popen(
            [str(BIN / "fgrpo"), "compose", recipe, "--out", str(interrupted), *sets, "--resume"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        target = rng.randint(10, 140)  # kill once the run has logged this many iterations
        metrics = interrupted / "metrics.jsonl"
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            if metrics.exists() and metrics.read_text().count("\n") >= target:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.002)
        proc.wait()
        last = interrupted / "checkpoints" / "last"
        if last.exists():  # whatever the moment of the kill, `last` names a complete checkpoint
            load_file(str(last / "trainable.safetensors"))
            assert json.loads((last / "state.json").read_text())["iteration"] % 7 == 0
    assert kills >= 1
    finish = run_fgrpo("compose", recipe, "--out", str(interrupted), *sets, "--resume")
    assert finish.returncode == 0, finish.stderr

    ref, got = _weights(reference), _weights(interrupted)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time_", "samples_per_s"))} for r in rows]

    def read(d):
        return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]

    assert strip(read(reference)) == strip(read(interrupted))


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _rank(pid: int) -> int | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def test_a_stopped_process_ends_the_run_with_a_message(root, tmp_path):
    """One rank stopped (SIGSTOP): the other waits train.process_group_timeout_s at its next
    collective, then the run ends with one line saying so (before: it waited silently forever)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launcher = torchrun()
    proc = subprocess.Popen(
        [
            *launcher,
            "-m",
            "fgrpo.core.cli",
            "compose",
            str(root / "recipes" / "vector.yaml"),
            "--out",
            str(out),
            "--quiet",
            "--set",
            "train.iterations=100000",
            "--set",
            "eval.every=0",
            "--set",
            "log.plots=false",
            "--set",
            "log.trackers=[]",
            "--set",
            "train.process_group_timeout_s=3",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stopped = None
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 3):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        ranks = {_rank(pid): pid for pid in _children(proc.pid)}
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        waited = time.time()
        while Path(f"/proc/{ranks[0]}").exists() and Path(f"/proc/{ranks[0]}/stat").read_text().split()[2] != "Z":
            assert time.time() - waited < 60, "rank 0 still waits for the stopped rank"  # before: forever
            time.sleep(0.1)
        os.kill(stopped, signal.SIGKILL)  # spare the launcher its 30 s of SIGTERM to a stopped process
        _, err = proc.communicate(timeout=120)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "error: process 0 of 2 lost the other processes in a collective" in err, err[-3000:]
    assert "train.process_group_timeout_s" in err
    assert "[rank0]: Traceback" not in err  # (the launcher still reports its failed child its own way)
