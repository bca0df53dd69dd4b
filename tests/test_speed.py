"""Speed machinery: the time accounting every iteration logs, the thread choice, the benchmarks.

No timed assertions: speed is shown by tools/bench/ (ratios measured in one run); these tests
check that the accounting adds up, that the thread choice reads what it should, and that the
benchmark tools run.
"""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest
import torch
from rich.console import Console

from fgrpo.core import recipe as recipe_mod
from fgrpo.core import threads, timing
from fgrpo.core.trainer import build_run, iteration

QUIET = Console(quiet=True)


def _tool(root, relative):
    path = root / "tools" / relative
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


# --- the accounting ------------------------------------------------------------------------------


def test_clock_sums_sections_and_counts_nested_ones_once():
    clock = timing.Clock("cpu")
    with clock.section("model"):
        time.sleep(0.01)
        with clock.section("model"):  # inside: not counted twice
            time.sleep(0.01)
    with clock.phase("reward"):
        with clock.section("model"):  # a reward's own network counts as reward
            time.sleep(0.01)
    seconds = clock.read()
    assert 0.02 <= seconds["model"] < 0.2 and 0.01 <= seconds["reward"] < 0.2
    assert "model" in seconds and clock.read() == {}  # read starts afresh


def test_accounting_is_the_rest_of_the_wall_time():
    out = timing.accounting({"model": 1.0, "reward": 0.5}, 2.0)
    assert out == {"time_model_s": 1.0, "time_reward_s": 0.5, "time_decode_s": 0.0, "time_overhead_s": 0.5, "time_iteration_s": 2.0}


def test_timed_policy_counts_network_calls_and_passes_everything_else():
    class Policy:
        device = torch.device("cpu")
        evaluations_per_call = 2

        def velocity(self, x, sigma, cond):
            time.sleep(0.01)
            return x

        def encode(self, prompts):
            return torch.zeros(len(prompts))

    clock = timing.Clock()
    policy = timing.TimedPolicy(Policy(), clock)
    assert policy.evaluations_per_call == 2 and policy.encode(["a"]).shape == (1,)
    x = torch.ones(3)
    assert policy.velocity(x, None, None) is x
    assert clock.read()["model"] >= 0.01


def test_every_iteration_accounts_for_its_seconds(root):
    recipe = recipe_mod.load(root / "recipes" / "vector.yaml", ["train.minibatch_size=0"])
    run = build_run(recipe, out_dir=None, console=QUIET, quiet=True)
    m = iteration(run, 0)
    parts = [m[f"time_{k}_s"] for k in ("model", "reward", "decode", "overhead")]
    assert all(p >= 0 for p in parts) and m["time_model_s"] > 0
    assert sum(parts) == pytest.approx(m["time_iteration_s"], rel=1e-6)
    assert m["time_model_s"] < m["time_iteration_s"]


# --- the thread choice ---------------------------------------------------------------------------


def test_cgroup_quota_caps_the_cpus(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert threads.cgroup_cpu_limit(tmp_path) == 3.0


def test_configure_keeps_what_the_user_chose():
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.configure(env) is None
    assert env == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    env = {}
    before = torch.get_num_threads()
    try:
        n = threads.configure(env)  # torch is loaded here: the count is applied, not exported
        assert n == threads.usable_cpus() and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    finally:
        torch.set_num_threads(before)


def test_governor_gives_cores_back_to_other_processes():
    t = {"wall": 0.0, "busy": 0.0, "own": 0.0}
    applied = []
    gov = threads.ThreadGovernor(
        usable=4, environ={}, busy=lambda: t["busy"], own=lambda: t["own"], clock=lambda: t["wall"], apply=applied.append
    )
    assert gov.active

    def interval(own_cpus, other_cpus, seconds=1.0):
        t["wall"] += seconds
        t["own"] += own_cpus * seconds
        t["busy"] += (own_cpus + other_cpus) * seconds
        return gov.step()

    assert interval(4, 0) == 4  # a quiet node: every usable CPU
    assert interval(3, 1) == 3  # one busy process beside us
    assert interval(2, 2.6) == 1  # at least one thread
    assert interval(1, 0.4) == 4  # the other job ended
    assert applied == [4, 3, 1, 4]
    assert threads.ThreadGovernor(usable=4, environ={"OMP_NUM_THREADS": "2"}, busy=lambda: 0.0).active is False
    assert threads.ThreadGovernor(usable=4, environ={}, busy=lambda: None).active is False


# --- the tools -----------------------------------------------------------------------------------


def test_iteration_bench_prints_the_breakdown_and_ratios(root, capsys):
    bench = _tool(root, "bench/iteration.py")
    recipe = str(root / "recipes" / "vector.yaml")
    assert bench.main([recipe, "--iterations", "2", "--set", "train.iterations=5", "--variant", "a", "--variant", "b: train.minibatch_size=0"]) == 0
    out = capsys.readouterr().out
    assert "model+reward" in out and "time per iteration b/a:" in out


def test_make_tiny_pipeline_writes_a_loadable_sd3_pipeline(root, tmp_path, capsys):
    diffusers = pytest.importorskip("diffusers")
    tool = _tool(root, "make_tiny_pipeline.py")
    assert tool.main(["sd3", str(tmp_path / "p")]) == 0
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(tmp_path / "p")
    assert pipe.transformer.config.in_channels == 16
    assert tool.main(["sd3", str(tmp_path / "p")]) == 2  # never writes over a folder
