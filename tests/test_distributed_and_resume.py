"""Runs that involve several processes: data parallelism on 2 CPU processes, and SIGKILL + resume."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _helpers import run_fgrpo

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_one(root, tmp_path):
    recipe = str(root / "recipes" / "vector.yaml")
    # one prompt group per rollout call: the noise of a group then depends only on its global slot
    sets = ["train.rollout_prompts=1", "train.prompts_per_iteration=4", "train.group_size=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one.json"
    two = tmp_path / "two.json"
    subprocess.run([sys.executable, str(HERE / "dp_worker.py"), recipe, str(one), "4", *sets], check=True, env=env, timeout=300)
    # static rendezvous on 127.0.0.1: `--standalone` connects to the machine's hostname, which a
    # sandbox or CI container may not resolve (seen in CI: the launcher exited 1)
    launcher = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    done = subprocess.run(
        [*launcher, str(HERE / "dp_worker.py"), recipe, str(two), "4", *sets],
        env=env, timeout=300, capture_output=True, text=True,
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
    for attempt in range(2):
        proc = subprocess.Popen(
            [str(BIN / "fgrpo"), "compose", recipe, "--out", str(interrupted), *sets, "--resume"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
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
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time_", "samples_per_s"))} for r in rows]
    read = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert strip(read(reference)) == strip(read(interrupted))
