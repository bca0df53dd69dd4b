"""Bad input that is not a recipe file: command-line arguments, rewards that misbehave, prompts a
model cannot read, damaged checkpoints. Each ends in one clear line and exit code 2, never a
traceback, and writes nothing (issue 9; the recipe files are in tests/bad_recipes)."""

from __future__ import annotations

import json
import pickle
import threading
from pathlib import Path

import pytest
import torch

from _helpers import ROOT
from fgrpo.core import cli, registry
from fgrpo.core.scoring import RewardError, score
from fgrpo.core.protocols import RewardResult
from fgrpo.core.recipe import RewardSpec

RECIPE = str(ROOT / "recipes" / "vector.yaml")
FAST = ["--quiet", "--set", "eval.every=0", "--set", "log.plots=false", "--set", "log.trackers=[]"]


def error_lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]


# --- command-line arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["sample", RECIPE, "--prompts", "p.txt", "--out", "o", "--n", "0"], "argument --n: expected an integer >= 1, got '0'"),
    (["sample", RECIPE, "--prompts", "p.txt", "--out", "o", "--n", "-1"], "argument --n: expected an integer >= 1, got '-1'"),
    (["sample", RECIPE, "--prompts", "p.txt", "--out", "o", "--steps", "-3"], "argument --steps: expected an integer >= 1, got '-3'"),
    (["check", RECIPE, "--tolerance", "nan"], "argument --tolerance: expected a finite number >= 0, got 'nan'"),
    (["compose", RECIPE, "--resume", "--start-over", "--out", "o"], "argument --start-over: not allowed with argument --resume"),
])
def test_bad_arguments_are_one_line(args, message, capsys):
    # before (argparse type=int/float, no bounds): --n 0 wrote 0 samples, --n -1 and --steps -3 failed
    # inside the sampler with a traceback, --tolerance nan made every check fail
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2
    assert error_lines(capsys) == [f"error: {message} (see fgrpo {args[0]} --help)"]


@pytest.mark.parametrize("prompts, message", [
    ("/dev/zero", "/dev/zero: holds NUL bytes; a prompt file is a text file"),  # before: read forever
    ("missing.txt", "cannot read missing.txt: No such file or directory"),
])
def test_sample_prompts_that_are_not_a_prompt_file(prompts, message, tmp_path, capsys):
    assert cli.main(["sample", RECIPE, "--prompts", prompts, "--out", str(tmp_path / "o")]) == 2
    assert error_lines(capsys) == [f"error: --prompts: {message}"]
    assert not (tmp_path / "o").exists()


def test_sample_out_that_is_a_file(tmp_path, capsys):
    prompts, out = tmp_path / "p.txt", tmp_path / "file"
    prompts.write_text("target 1 1\n")
    out.write_text("x")
    assert cli.main(["sample", RECIPE, "--prompts", str(prompts), "--out", str(out)]) == 2
    assert error_lines(capsys) == [f"error: --out: cannot create {out}: File exists"]


def test_a_prompt_outside_the_models_vocabulary(root, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["compose", str(root / "recipes" / "shapes.yaml"), "--out", str(out), *FAST,
                     "--set", 'prompts={name: list, train: ["a purple hexagon", "two red squares"]}'])
    assert code == 2  # before: a ValueError traceback from the first rollout
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: prompts: prompt 'a purple hexagon': word(s) ['purple', 'hexagon'] not in")
    assert not out.exists()


# --- rewards that misbehave ---------------------------------------------------------------------


class _Misbehaving:
    def __init__(self, returns):
        self.returns = returns

    def __call__(self, outputs, prompts, metadata):
        if isinstance(self.returns, Exception):
            raise self.returns
        return self.returns


PROMPTS = ["a cat", "a dog", "a cat"]


@pytest.mark.parametrize("returns, message", [
    (None, "reward 'r' returned None for the batch of iteration 3 (3 samples of the prompts 'a cat', 'a dog'); expected a RewardResult"),
    ("good", "reward 'r' returned 'good' for the batch of iteration 3"),
    (RewardResult(scores=["x", "y", "z"]), "reward 'r' returned scores ['x', 'y', 'z'] for the batch of iteration 3 (3 samples of the prompts 'a cat', 'a dog'); expected a tensor of numbers"),
    (RewardResult(scores=None), "reward 'r' returned scores None for the batch of iteration 3"),
    (KeyError("clip_model"), "reward 'r' raised KeyError: 'clip_model' on the batch of iteration 3 (3 samples of the prompts 'a cat', 'a dog')"),
])
def test_a_reward_that_misbehaves_is_named_with_the_prompts(returns, message):
    spec = RewardSpec("r", "r", 1.0, {})
    with pytest.raises(RewardError) as info:  # before: AttributeError / TypeError / the reward's own traceback
        score([(spec, _Misbehaving(returns))], torch.zeros(3, 2), PROMPTS, [{}] * 3, where="the batch of iteration 3")
    assert message in str(info.value)


def test_a_reward_that_never_returns_times_out():
    release = threading.Event()

    class Stuck:
        def __call__(self, outputs, prompts, metadata):
            release.wait()  # a reward server that never answers
            return RewardResult(scores=torch.zeros(len(prompts)))

    spec = RewardSpec("remote", "remote", 1.0, {}, timeout_s=0.3)
    try:
        with pytest.raises(RewardError, match=r"reward 'remote' did not return within 0.3 s \(reward.timeout_s\) on the batch of iteration 3 \(3 samples of the prompts 'a cat', 'a dog'\)"):
            score([(spec, Stuck())], torch.zeros(3, 2), PROMPTS, [{}] * 3, where="the batch of iteration 3")
    finally:
        release.set()
    quick = RewardSpec("quick", "quick", 1.0, {}, timeout_s=5)
    scores, _ = score([(quick, _Misbehaving(RewardResult(scores=torch.ones(3))))], torch.zeros(3, 2), PROMPTS, [{}] * 3, where="x")
    assert torch.equal(scores["quick"], torch.ones(3))


@pytest.fixture
def exploding_reward(monkeypatch):
    """A reward named 'exploding' that raises on its first call (as if installed)."""

    class Exploding:
        def __call__(self, outputs, prompts, metadata):
            raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setitem(registry._loaded, ("reward", "exploding"), Exploding)


def test_a_failing_reward_stops_compose_with_one_line(exploding_reward, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["compose", RECIPE, "--out", str(out), *FAST, "--set", "reward={name: exploding}"])
    assert code == 2
    lines = error_lines(capsys)
    assert len(lines) == 1
    assert lines[0].startswith("error: reward 'exploding' raised RuntimeError: CUDA error: device-side assert triggered on the batch of iteration 0 (64 samples of the prompts 'target ")


def test_reward_timeout_is_a_checked_recipe_key(capsys):
    assert cli.main(["validate", RECIPE, "--set", "reward={name: target-distance, timeout_s: 0}"]) == 2
    assert error_lines(capsys) == ["error: reward.timeout_s: got 0.0; allowed: > 0"]
    assert cli.main(["validate", RECIPE, "--set", "reward={name: target-distance, timeout_s: 30}"]) == 0


# --- damaged checkpoints ------------------------------------------------------------------------


@pytest.fixture
def run(tmp_path) -> Path:
    out = tmp_path / "run"
    assert cli.main(["compose", RECIPE, "--out", str(out), *FAST, "--set", "train.iterations=1"]) == 0
    return out


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-9])


DAMAGE = {
    "truncated weights": (lambda c: _truncate(c / "trainable.safetensors"), "trainable.safetensors is truncated"),
    "broken state.json": (lambda c: (c / "state.json").write_text('{"iteration": 1, "recipe": {'), "state.json is not valid JSON"),
    "weights that are not safetensors": (lambda c: (c / "trainable.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"not json" * 2), "trainable.safetensors is not a safetensors file"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_sample_refuses_a_damaged_checkpoint(run, damage, tmp_path, capsys):
    spoil, why = DAMAGE[damage]
    spoil(run / "checkpoints" / "iter_000001")
    prompts = tmp_path / "p.txt"
    prompts.write_text("target 1 1\n")
    code = cli.main(["sample", "--checkpoint", str(run / "checkpoints" / "iter_000001"), "--prompts", str(prompts),
                     "--out", str(tmp_path / "s")])
    assert code == 2  # before: a safetensors / JSON traceback
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: --checkpoint: ") and why in lines[0], lines
    assert "is not a valid checkpoint" in lines[0] or "state.json" in lines[0]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_refuses_a_run_whose_only_checkpoint_is_damaged(run, damage, capsys):
    spoil, why = DAMAGE[damage]
    spoil(run / "checkpoints" / "iter_000001")
    before = (run / "metrics.jsonl").read_bytes()
    assert cli.main(["compose", RECIPE, "--out", str(run), *FAST, "--set", "train.iterations=2", "--resume"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "holds a run but no complete checkpoint" in lines[0] and why in lines[0], lines
    assert (run / "metrics.jsonl").read_bytes() == before


class _Planted:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/fgrpo-pickle-ran"),))


def test_a_pickle_planted_in_the_optimizer_state_never_runs(run, capsys):
    marker = Path("/tmp/fgrpo-pickle-ran")
    marker.unlink(missing_ok=True)
    torch.save({"optimizer": _Planted(), "scheduler": {}}, run / "checkpoints" / "iter_000001" / "optimizer.pt")
    assert cli.main(["compose", RECIPE, "--out", str(run), *FAST, "--set", "train.iterations=2", "--resume"]) == 2
    lines = error_lines(capsys)  # before: the refusal was torch's multi-line UnpicklingError traceback
    assert lines == [f"error: --resume: {run / 'checkpoints' / 'iter_000001'} is not a valid checkpoint: "
                     "optimizer.pt holds objects other than tensors and numbers (refused to unpickle them)"]
    assert not marker.exists()
    assert pickle.dumps  # (the planted object is only ever unpickled by torch.load(weights_only=True))


def test_state_that_reads_but_does_not_fit(run, capsys):
    state = json.loads((run / "checkpoints" / "iter_000001" / "state.json").read_text())
    state["sampler"] = {"window_start": "nonsense"}
    (run / "checkpoints" / "iter_000001" / "state.json").write_text(json.dumps(state))
    torch.save({"optimizer": {"state": {}, "param_groups": []}, "scheduler": {}}, run / "checkpoints" / "iter_000001" / "optimizer.pt")
    assert cli.main(["compose", RECIPE, "--out", str(run), *FAST, "--set", "train.iterations=2", "--resume"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "is not a valid checkpoint of this run" in lines[0], lines
