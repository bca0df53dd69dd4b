"""Multi-node data parallelism as accelerate runs it: 2 "machines" x 1 process on this host
(accelerate's multi-machine launch: num_machines 2, machine_rank 0 and 1, main_process_ip
127.0.0.1, one port) against the same run as 2 processes of one machine: the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _helpers import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
SETS = ["train.rollout_prompts=1", "train.prompts_per_iteration=4", "train.group_size=4"]


def _config(root: Path, tmp_path: Path, machines: int) -> Path:
    """recipes/accelerate/multi-node.yaml on the CPU: the shipped file with the CPU's settings (gloo,
    no mixed precision) and 1 process per machine."""
    config = yaml.safe_load((root / "recipes" / "accelerate" / "multi-node.yaml").read_text())
    config.update(
        num_machines=machines, num_processes=2, use_cpu=True, mixed_precision="no", gpu_ids=None, same_network=True
    )
    path = tmp_path / f"{machines}-machines.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_two_machines_match_one_machine_of_two_processes(root, tmp_path):
    recipe = str(root / "recipes" / "vector.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = [str(HERE / "dp_worker.py"), recipe]
    port = free_port()
    machines = [
        subprocess.Popen(
            [
                str(BIN / "accelerate"),
                "launch",
                "--config_file",
                str(_config(root, tmp_path, 2)),
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                *worker,
                str(tmp_path / f"machines-{rank}.json"),
                "3",
                *SETS,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [m.communicate(timeout=600) for m in machines]
    for m, (_, err) in zip(machines, outputs, strict=True):
        assert m.returncode == 0, err[-4000:]
    single = subprocess.run(
        [
            str(BIN / "accelerate"),
            "launch",
            "--config_file",
            str(root / "recipes" / "accelerate" / "cpu.yaml"),
            "--main_process_port",
            str(free_port()),
            *worker,
            str(tmp_path / "one-machine.json"),
            "3",
            *SETS,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr[-4000:]
    two = json.loads((tmp_path / "machines-0.json").read_text())  # the main process (machine 0) writes
    one = json.loads((tmp_path / "one-machine.json").read_text())
    assert not (tmp_path / "machines-1.json").exists()
    assert two["processes"] == one["processes"] == 2
    assert all(two["identical"]) and two["rewards"] == one["rewards"]
    assert two["weights"] == one["weights"]  # exactly: the same reductions over the same 2 ranks
