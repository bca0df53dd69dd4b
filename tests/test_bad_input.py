"""Bad input that is not a recipe file: command-line arguments, rewards that misbehave, prompts a
model cannot read, damaged checkpoints. Each ends in one clear line and exit code 2, never a
traceback, and writes nothing (issue 9; the recipe files are in tests/bad_recipes)."""

from __future__ import annotations

import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

from _helpers import ROOT
from fgrpo.core import cli, registry
from fgrpo.core.protocols import RewardResult
from fgrpo.core.recipe import RewardSpec
from fgrpo.core.scoring import RewardError, score

RECIPE = str(ROOT / "recipes" / "vector.yaml")
FAST = ["--quiet", "--set", "eval.every=0", "--set", "log.plots=false", "--set", "log.trackers=[]"]


def error_lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]


# --- command-line arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["sample", RECIPE, "--prompts", "p.txt", "--out", "o", "--n", "0"],
            "argument --n: expected an integer from 1 to 100000, got '0'",
        ),
        (
            ["sample", RECIPE, "--prompts", "p.txt", "--out", "o", "--n", "-1"],
            "argument --n: expected an integer from 1 to 100000, got '-1'",
        ),
        (  # before: a torch allocation traceback (issue 50, LOW)
            ["sample", RECIPE, "--prompts", "p.txt", "--out", "o", "--n", str(10**20)],
            f"argument --n: expected an integer from 1 to 100000, got '{10**20}'",
        ),
        (
            ["sample", RECIPE, "--prompts", "p.txt", "--out", "o", "--steps", "-3"],
            "argument --steps: expected an integer from 1 to 10000, got '-3'",
        ),
        (["check", RECIPE, "--tolerance", "nan"], "argument --tolerance: expected a finite number >= 0, got 'nan'"),
        (
            ["compose", RECIPE, "--resume", "--start-over", "--out", "o"],
            "argument --start-over: not allowed with argument --resume",
        ),
    ],
)
def test_bad_arguments_are_one_line(args, message, capsys):
    # before (argparse type=int/float, no bounds): --n 0 wrote 0 samples, --n -1 and --steps -3 failed
    # inside the sampler with a traceback, --tolerance nan made every check fail
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2
    assert error_lines(capsys) == [f"error: {message} (see fgrpo {args[0]} --help)"]


@pytest.mark.parametrize(
    "prompts, message",
    [
        ("/dev/zero", "/dev/zero: holds NUL bytes; a prompt file is a text file"),  # before: read forever
        ("missing.txt", "cannot read missing.txt: No such file or directory"),
    ],
)
def test_sample_prompts_that_are_not_a_prompt_file(prompts, message, tmp_path, capsys):
    assert cli.main(["sample", RECIPE, "--prompts", prompts, "--out", str(tmp_path / "o")]) == 2
    assert error_lines(capsys) == [f"error: --prompts: {message}"]
    assert not (tmp_path / "o").exists()


def test_sample_out_that_is_a_file(tmp_path, capsys):
    prompts, out = tmp_path / "p.txt", tmp_path / "file"
    prompts.write_text("target 1 1\n")
    out.write_text("x")
    assert cli.main(["sample", RECIPE, "--prompts", str(prompts), "--out", str(out)]) == 2
    assert error_lines(capsys) == [f"error: --out: {out} is a file; expected a new or empty folder"]


def test_a_prompt_outside_the_models_vocabulary(root, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(
        [
            "compose",
            str(root / "recipes" / "shapes.yaml"),
            "--out",
            str(out),
            *FAST,
            "--set",
            'prompts={name: list, train: ["a purple hexagon", "two red squares"]}',
        ]
    )
    assert code == 2  # before: a ValueError traceback from the first rollout
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(
        "error: prompts: prompt 'a purple hexagon': word(s) ['purple', 'hexagon'] not in"
    )
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


@pytest.mark.parametrize(
    "returns, message",
    [
        (
            None,
            "reward 'r' returned None for the batch of iteration 3 (3 samples of the prompts 'a cat', 'a dog'); "
            "expected a RewardResult",
        ),
        ("good", "reward 'r' returned 'good' for the batch of iteration 3"),
        (
            RewardResult(scores=["x", "y", "z"]),
            "reward 'r' returned scores ['x', 'y', 'z'] for the batch of iteration 3 (3 samples of the prompts 'a "
            "cat', 'a dog'); expected a tensor of numbers",
        ),
        (RewardResult(scores=None), "reward 'r' returned scores None for the batch of iteration 3"),
        (
            KeyError("clip_model"),
            "reward 'r' raised KeyError: 'clip_model' on the batch of iteration 3 (3 samples of the prompts 'a cat', "
            "'a dog')",
        ),
    ],
)
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
        with pytest.raises(
            RewardError,
            match=r"reward 'remote' did not return within 0.3 s \(reward.timeout_s\) on the batch of iteration 3 \(3 "
            r"samples of the prompts 'a cat', 'a dog'\)",
        ):
            score([(spec, Stuck())], torch.zeros(3, 2), PROMPTS, [{}] * 3, where="the batch of iteration 3")
    finally:
        release.set()
    quick = RewardSpec("quick", "quick", 1.0, {}, timeout_s=5)
    scores, _ = score(
        [(quick, _Misbehaving(RewardResult(scores=torch.ones(3))))], torch.zeros(3, 2), PROMPTS, [{}] * 3, where="x"
    )
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
    assert lines[0].startswith(
        "error: reward 'exploding' raised RuntimeError: CUDA error: device-side assert triggered on the batch of "
        "iteration 0 (64 samples of the prompts 'target "
    )


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
    "broken state.json": (
        lambda c: (c / "state.json").write_text('{"iteration": 1, "recipe": {'),
        "state.json is not valid JSON",
    ),
    "weights that are not safetensors": (
        lambda c: (c / "trainable.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"not json" * 2),
        "trainable.safetensors is not a safetensors file",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_sample_refuses_a_damaged_checkpoint(run, damage, tmp_path, capsys):
    spoil, why = DAMAGE[damage]
    spoil(run / "checkpoints" / "iter_000001")
    prompts = tmp_path / "p.txt"
    prompts.write_text("target 1 1\n")
    code = cli.main(
        [
            "sample",
            "--checkpoint",
            str(run / "checkpoints" / "iter_000001"),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "s"),
        ]
    )
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
    assert lines == [
        f"error: --resume: {run / 'checkpoints' / 'iter_000001'} is not a valid checkpoint: "
        "optimizer.pt holds objects other than tensors and numbers (refused to unpickle them)"
    ]
    assert not marker.exists()
    assert pickle.dumps  # (the planted object is only ever unpickled by torch.load(weights_only=True))


def test_state_that_reads_but_does_not_fit(run, capsys):
    state = json.loads((run / "checkpoints" / "iter_000001" / "state.json").read_text())
    state["sampler"] = {"window_start": "nonsense"}
    (run / "checkpoints" / "iter_000001" / "state.json").write_text(json.dumps(state))
    torch.save(
        {"optimizer": {"state": {}, "param_groups": []}, "scheduler": {}},
        run / "checkpoints" / "iter_000001" / "optimizer.pt",
    )
    assert cli.main(["compose", RECIPE, "--out", str(run), *FAST, "--set", "train.iterations=2", "--resume"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and "is not a valid checkpoint of this run" in lines[0], lines


# --- issue 22: the Low items, each one line and exit 2 where a traceback or a hang was ------------


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from fgrpo.core.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    "limit, sets, where",
    [
        # optimizer.pt is the first file past 40 kB: torch.save's "unexpected pos" RuntimeError before
        (40_000, ["train.iterations=2", "train.checkpoint_every=1"], "cannot write the checkpoint of iteration 1 ("),
        # metrics.jsonl grows past 6 kB before the first checkpoint: an OSError traceback before
        (6_000, ["train.iterations=12", "train.checkpoint_every=0"], "cannot append to "),
    ],
)
def test_a_full_disk_is_one_line_and_loses_nothing(limit, sets, where, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    args = ["compose", RECIPE, "--out", str(out), *FAST, *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(limit), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and where in lines[0] and "File too large" in lines[0], done.stderr
    assert not list((out / "checkpoints").glob(".tmp-*")) if (out / "checkpoints").exists() else True
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    assert rows and [r["iteration"] for r in rows] == list(range(1, len(rows) + 1))


def test_a_component_that_cannot_get_its_memory_is_one_line(monkeypatch):
    class Huge:
        def __init__(self):
            torch.empty(1 << 61, dtype=torch.uint8)  # fails at once, touches nothing

    monkeypatch.setitem(registry._loaded, ("model", "huge"), Huge)
    with pytest.raises(registry.BuildError) as info:  # before: torch's RuntimeError traceback
        registry.create("model", "huge")
    message = str(info.value)
    assert message.startswith("model 'huge' could not be built: out of memory (") and "\n" not in message


@pytest.mark.parametrize("raised", ["KeyboardInterrupt", "BaseException('odd')", "GeneratorExit"])
def test_a_plugin_raising_a_base_exception_at_import_leaves_every_command(raised, tmp_path, monkeypatch, capsys):
    import sys

    from fgrpo.core import hookspecs

    (tmp_path / "rude_plugin.py").write_text(f"raise {raised}\n")
    info = tmp_path / "rude-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rude\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fgrpo.plugins]\nrude = rude_plugin\n[fgrpo.rewards]\nrude = rude_plugin:Rude\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hookspecs, "_manager", None)
    monkeypatch.setattr(hookspecs, "_failures", [])
    monkeypatch.delitem(sys.modules, "rude_plugin", raising=False)
    with pytest.raises(SystemExit) as version:  # before: the exception killed every command, --version too
        cli.main(["--version"])
    assert version.value.code == 0 and "fgrpo-core" in capsys.readouterr().out
    assert cli.main(["plugins"]) == 0
    name = raised.split("(")[0]
    assert f"hook plugin rude: import error ({name}" in capsys.readouterr().out
    assert cli.main(["validate", RECIPE, "--set", "reward={name: rude}"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and f"reward 'rude' from rude failed to import: {name}" in lines[0], lines


@pytest.mark.parametrize("what", ["recipe", "prompts"])
def test_a_fifo_is_refused_not_waited_on(what, tmp_path, capsys):
    fifo = tmp_path / ("recipe.yaml" if what == "recipe" else "prompts.txt")
    os.mkfifo(fifo)
    done = threading.Event()
    codes = []

    def call():  # before: open() blocked forever waiting for a writer
        if what == "recipe":
            codes.append(cli.main(["validate", str(fifo)]))
        else:
            codes.append(cli.main(["sample", RECIPE, "--prompts", str(fifo), "--out", str(tmp_path / "o")]))
        done.set()

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    if not done.wait(20):
        with open(fifo, "w"):  # let the blocked reader go
            pass
        worker.join(5)
        pytest.fail("waited on the FIFO")
    assert codes == [2]
    lines = error_lines(capsys)
    assert len(lines) == 1 and f"{fifo}: is a FIFO, not a regular file" in lines[0], lines


BAD_PROMPTS = Path(__file__).parent / "bad_prompts"


@pytest.mark.parametrize(
    "folder, message",
    [
        ("broken_jsonl", "prompts.path: {path}/train.jsonl:2: not a JSON object ("),
        ("empty", "prompts.path: {path}/train.txt: no prompts"),
    ],
)
def test_validate_reads_the_prompt_files_compose_would_refuse(folder, message, tmp_path, capsys):
    path = BAD_PROMPTS / folder
    sets = ["--set", f"prompts={{name: folder, path: {path}, test: null}}"]
    assert cli.main(["validate", RECIPE, *sets]) == 2  # before: "ok", then compose refused
    assert cli.main(["compose", RECIPE, *sets, "--out", str(tmp_path / "run"), *FAST]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 2 and all(message.format(path=path) in line for line in lines), lines
    assert not (tmp_path / "run").exists()
    text_file = [
        "--set",
        f"prompts={{name: text-file, train: {path / ('train.jsonl' if folder == 'broken_jsonl' else 'train.txt')}}}",
    ]
    assert cli.main(["validate", RECIPE, *text_file]) == 2
    assert "prompts.train: " in error_lines(capsys)[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-request-mb", "nan"], "argument --max-request-mb: expected a finite number > 0, got 'nan'"),
        (["--max-request-mb", "0"], "argument --max-request-mb: expected a finite number > 0, got '0'"),
        (["--port", "99999"], "argument --port: expected a port number from 0 to 65535, got '99999'"),
        (["--port", "-5"], "argument --port: expected a port number from 0 to 65535, got '-5'"),
        (["--read-timeout-s", "inf"], "argument --read-timeout-s: expected a finite number > 0, got 'inf'"),
        (["--max-connections", "0"], "argument --max-connections: expected an integer >= 1, got '0'"),
    ],
)
def test_serve_reward_arguments_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as info:  # before: a traceback (nan, a port out of range) at bind
        cli.main(["serve-reward", "jpeg-compressibility", *args])
    assert info.value.code == 2
    assert error_lines(capsys) == [f"error: {message} (see fgrpo serve-reward --help)"]


@pytest.mark.parametrize(
    "item, problem",
    [
        ("form=[unclosed", "error: --set form: got '[unclosed': malformed YAML: expected ',' or ']'"),
        ("x=!!python/name:os.system", "error: --set x: got '!!python/name:os.system': the YAML tag "),
    ],
)
def test_serve_reward_set_values_that_are_not_plain_yaml_are_one_line(item, problem, capsys):
    # before: PyYAML's traceback and exit 1
    assert cli.main(["serve-reward", "jpeg-compressibility", "--set", item]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(problem), lines
    assert lines[0].endswith(
        "expected a plain YAML value (a number, a string, true or false, [a, list], {a: mapping})"
    )


def test_serve_reward_on_a_port_in_use_or_a_host_it_cannot_bind(capsys, monkeypatch):
    import socket

    monkeypatch.setenv("FGRPO_REWARD_TOKEN", "a-token")  # another host than 127.0.0.1 needs one

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert (
            cli.main(["serve-reward", "jpeg-compressibility", "--port", str(port)]) == 2
        )  # before: OSError traceback
        assert error_lines(capsys) == [
            f"error: --port: 127.0.0.1:{port} is in use (another server?); choose another port, or 0 for any free one"
        ]
    assert cli.main(["serve-reward", "jpeg-compressibility", "--host", "no-such-host.invalid"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: --host: cannot listen on 'no-such-host.invalid': "), lines


# --- messages that said the wrong thing (issue 50, LOW) -----------------------------------------


def test_report_into_a_folder_that_takes_no_files_says_so(run, capsys):
    """Before: "cannot write /proc/version: No such file or directory", of a file that exists."""
    assert cli.main(["report", str(run), "--out", "/proc/version"]) == 2
    assert error_lines(capsys) == [
        "error: --out: cannot write /proc/version (a new file in /proc: No such file or directory); "
        "nothing was written"
    ]


@pytest.mark.parametrize("where", ["nowhere", "a file"])
def test_sample_from_a_checkpoint_that_is_not_a_folder_says_what_it_is(run, tmp_path, where, capsys):
    (tmp_path / "p.txt").write_text("target 1 1\n")
    given = tmp_path / "nowhere" if where == "nowhere" else run / "metrics.jsonl"
    args = ["sample", "--checkpoint", str(given), "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "s")]
    assert cli.main(args) == 2
    [line] = error_lines(capsys)
    expected = "does not exist" if where == "nowhere" else "is a file; expected a folder"
    assert line.startswith(f"error: --checkpoint: {given} {expected}") and "state.json" not in line


def test_a_report_that_could_not_be_written_is_not_named(tmp_path, monkeypatch, capsys):
    """Before: compose said "report: RUN/report.html" after "report.html not written"."""
    from fgrpo.core import report
    from fgrpo.core.config import ConfigError, RecipeError

    def full(*args, **kwargs):
        raise RecipeError([ConfigError("--out", "cannot write report.html: No space left on device")])

    monkeypatch.setattr(report, "write", full)
    assert cli.main(["compose", RECIPE, "--out", str(tmp_path / "run"), *FAST, "--set", "train.iterations=1"]) == 0
    out = capsys.readouterr().out
    assert "report.html not written: --out: cannot write report.html: No space left on device" in out
    assert "report: " not in out


def test_curves_are_written_whole_or_not_at_all(run, monkeypatch, capsys):
    """A full disk while curves.png is written leaves the previous picture whole (before: cut)."""
    from fgrpo.core import confine, visuals

    pytest.importorskip("matplotlib")
    picture = run / "curves.png"
    picture.write_bytes(b"the previous picture")
    real = confine.write_atomic

    def full(path, data):
        if Path(path).name == "curves.png":
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(confine, "write_atomic", full)
    rows = [{"iteration": i, "reward_mean": float(i)} for i in range(3)]
    with pytest.raises(OSError):
        visuals.curves(rows, picture)
    assert picture.read_bytes() == b"the previous picture"
