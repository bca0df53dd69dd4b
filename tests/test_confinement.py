"""Nothing leaks, nothing lies (issue 22): `report`, `export`, `sample` and resume read a run
folder's or a checkpoint's own files only (never through a link, never a name that leads out of
it), check a checkpoint completely before claiming anything, and refuse what they cannot do with
one line and exit code 2.

The crafted run folders are in tests/bad_runs; each is copied next to a ``secret.txt`` (and a
``secret-samples/`` folder) that a leaking command would read. Checkpoints are damaged at test
time from a real run of the vector recipe."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _helpers import ROOT, OpenAudit
from fgrpo.core import cli

BAD_RUNS = Path(__file__).parent / "bad_runs"
RECIPE = str(ROOT / "recipes" / "vector.yaml")
FAST = ["--quiet", "--set", "eval.every=0", "--set", "log.plots=false", "--set", "log.trackers=[]"]
SECRET = b"SECRET-22: a file outside the run folder\n"


def error_lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return [ln for ln in captured.err.splitlines() if ln.startswith("error: ")]


def snapshot(folder: Path) -> dict[str, str]:
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            found[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def leaked(*folders: Path) -> list[str]:
    """Files under ``folders`` that hold the secret, plain or base64 (as a data URI would)."""
    marks = (SECRET, base64.b64encode(SECRET), SECRET.strip())
    hits = []
    for folder in folders:
        for path in folder.rglob("*") if folder.is_dir() else [folder]:
            if path.is_file() and not path.is_symlink() and any(m in path.read_bytes() for m in marks):
                hits.append(str(path))
    return hits


@pytest.fixture
def outside(tmp_path) -> Path:
    """tmp/secret.txt and tmp/secret-samples/eval_000000/ (an evaluation of another run)."""
    (tmp_path / "secret.txt").write_bytes(SECRET)
    other = tmp_path / "secret-samples" / "eval_000000"
    other.mkdir(parents=True)
    shutil.copy(tmp_path / "secret.txt", other / "00.png")
    (other / "index.json").write_text(json.dumps([{"prompt": "p", "file": "00.png", "score": 1.0}]))
    return tmp_path


def bad_run(name: str, outside: Path) -> Path:
    run = outside / "run"
    shutil.copytree(BAD_RUNS / name, run, symlinks=True)
    return run


# --- report -------------------------------------------------------------------------------------

# each crafted folder -> the one line the report is refused with (before: the secret embedded, or
# the other run's images shown as this one's)
REFUSED = {
    "tile_absolute": "tile 1 names '/etc/hostname', which is not a file of",
    "tile_dotdot": "tile 1 names '../../../secret.txt', which is not a file of",
    "tile_link": "samples/eval_000000/01.png is a link",
    "folder_link": "samples/eval_000000/deeper is a link",
    "tile_not_a_name": "tile 1 names 7, which is not a file of",
    "recipe_link": "recipe.resolved.yaml is a link",
    "metrics_link": "metrics.jsonl is a link",
    "samples_link": "samples is a link",
    "index_link": "samples/eval_000000/index.json is a link",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_report_never_reads_outside_the_run(name, outside, capsys):
    run = bad_run(name, outside)
    around = snapshot(outside / "secret-samples") | {"secret": hashlib.sha256(SECRET).hexdigest()}
    assert cli.main(["report", str(run)]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and REFUSED[name] in lines[0], lines
    assert "never through links" in lines[0] or "not a file of" in lines[0]
    assert not (run / "report.html").exists() and leaked(outside / "run") == []
    assert (
        snapshot(outside / "secret-samples")
        | {"secret": hashlib.sha256((outside / "secret.txt").read_bytes()).hexdigest()}
        == around
    )


def test_the_bad_runs_corpus_is_complete():
    tolerated = {"metrics_cut", "metrics_garbage", "recipe_bad_yaml", "recipe_not_a_mapping", "index_garbage"}
    assert sorted(p.name for p in BAD_RUNS.iterdir()) == sorted(set(REFUSED) | tolerated)


@pytest.mark.parametrize(
    "name, note",
    [
        (
            "metrics_cut",
            "1 line of metrics.jsonl is not a metrics row (a line cut by a kill or a full disk?): left out",
        ),
        (
            "metrics_garbage",
            "7 lines of metrics.jsonl are not metrics rows (a line cut by a kill or a full disk?): left out",
        ),
        ("recipe_bad_yaml", "recipe.resolved.yaml does not read as YAML"),
        ("recipe_not_a_mapping", "recipe.resolved.yaml is not a recipe (a list)"),
        ("index_garbage", "samples/eval_000000/index.json is not a list of tiles: left out"),
    ],
)
def test_report_of_damaged_files_says_what_it_left_out(name, note, outside, capsys):
    # before: JSONDecodeError (a cut line), KeyError/TypeError/AttributeError tracebacks
    run = bad_run(name, outside)
    assert cli.main(["report", str(run)]) == 0
    assert error_lines(capsys) == []
    text = (run / "report.html").read_text()
    assert note in text, text[:2000]
    assert "iterations</th><td>1 of" in text


def test_report_out_that_cannot_be_written(outside, capsys):
    run = bad_run("metrics_cut", outside)
    folder = outside / "a-folder"
    folder.mkdir()
    long = outside / ("r" * 300 + ".html")
    cases = [
        (folder, f"error: --out: {folder} is a folder; give the report's file name (e.g. {folder}/report.html)"),
        (run, f"error: --out: {run} is a folder; give the report's file name (e.g. {run}/report.html)"),
        (Path("/proc/version"), "error: --out: cannot write /proc/version (a new file in /proc: "),
        (long, f"error: --out: cannot write {long}: File name too long"),
        (
            outside / "secret.txt" / "r.html",
            f"error: --out: cannot write {outside / 'secret.txt' / 'r.html'}: Not a directory",
        ),
    ]
    for target, message in cases:
        before = snapshot(outside)
        assert cli.main(["report", str(run), "--out", str(target)]) == 2  # before: tracebacks, RUN.tmp left
        lines = error_lines(capsys)
        assert len(lines) == 1 and lines[0].startswith(message), lines
        assert snapshot(outside) == before
    assert not list(outside.glob("*.tmp*")) and not list(run.glob("*.tmp*"))


def test_report_writes_through_no_link(outside, capsys):
    # a report.html (or the temporary file next to it) planted as a link is replaced, not written through
    run = bad_run("metrics_cut", outside)
    os.symlink(outside / "secret.txt", run / "report.html")
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        os.symlink(outside / "secret.txt", run / f".report.html.tmp-{pid}")
    assert cli.main(["report", str(run)]) == 0
    assert (outside / "secret.txt").read_bytes() == SECRET
    assert not (run / "report.html").is_symlink() and (run / "report.html").stat().st_size > 1000


# --- checkpoints: export, sample, resume ----------------------------------------------------------


@pytest.fixture(scope="module")
def ema_base(tmp_path_factory) -> Path:
    """A finished vector run with an EMA and checkpoints 1 and 2, each given an export/ folder the
    way a LoRA backbone writes one (export/pytorch_lora_weights.safetensors)."""
    out = tmp_path_factory.mktemp("ema") / "run"
    assert (
        cli.main(
            [
                "compose",
                RECIPE,
                "--out",
                str(out),
                *FAST,
                "--set",
                "train.iterations=2",
                "--set",
                "train.checkpoint_every=1",
                "--set",
                "train.ema_decay=0.5",
            ]
        )
        == 0
    )
    for folder in (out / "checkpoints").glob("iter_*"):
        (folder / "export").mkdir()
        save_file({"lora.weight": torch.ones(8, 8)}, str(folder / "export" / "pytorch_lora_weights.safetensors"))
    return out


@pytest.fixture
def ema_run(ema_base, tmp_path) -> Path:
    """A copy of the EMA run of this module, to damage."""
    return Path(shutil.copytree(ema_base, tmp_path / "run", symlinks=True))


def _cut(path: Path, size: int = 50) -> None:
    path.write_bytes(path.read_bytes()[:size])


DAMAGE = {
    "truncated weights": (lambda c: _cut(c / "trainable.safetensors", 200), "trainable.safetensors is truncated"),
    "broken state.json": (
        lambda c: (c / "state.json").write_text('{"iteration": 2, "recipe": {'),
        "state.json is not valid JSON",
    ),
    "export cut to 50 bytes": (
        lambda c: _cut(c / "export" / "pytorch_lora_weights.safetensors"),
        "export/pytorch_lora_weights.safetensors is truncated",
    ),
    "truncated EMA": (lambda c: _cut(c / "ema.safetensors", 100), "ema.safetensors is truncated"),
    "a link out of it": (lambda c: (c / "export" / "etc").symlink_to("/etc"), "export/etc is a link"),
    "weights through a link": (lambda c: _relink(c / "trainable.safetensors"), "trainable.safetensors is a link"),
    "a FIFO": (lambda c: os.mkfifo(c / "export" / "pipe"), "export/pipe is not a regular file"),
}


def _relink(path: Path) -> None:
    copy = path.parent.parent.parent.parent / "elsewhere.safetensors"
    shutil.copy(path, copy)
    path.unlink()
    path.symlink_to(copy)


@pytest.mark.parametrize("command", ["export", "sample"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_export_and_sample_check_the_checkpoint_completely_first(ema_run, damage, command, tmp_path, capsys):
    spoil, why = DAMAGE[damage]
    checkpoint = ema_run / "checkpoints" / "iter_000002"
    spoil(checkpoint)
    prompts = tmp_path / "p.txt"
    prompts.write_text("target 1 1\n")
    out = tmp_path / "out"
    args = {
        "export": ["export", str(checkpoint)],
        "sample": ["sample", "--checkpoint", str(checkpoint), "--prompts", str(prompts)],
    }
    # before: "exported (EMA weights)", exit 0, the 50-byte file (or all of /etc) copied, or a traceback
    assert cli.main([*args[command], "--out", str(out)]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and f"{checkpoint} is not a valid checkpoint: " in lines[0] and why in lines[0], lines
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resume_skips_the_damaged_checkpoint_the_same_way(ema_run, damage, capsys):
    spoil, why = DAMAGE[damage]
    spoil(ema_run / "checkpoints" / "iter_000002")
    assert (
        cli.main(
            [
                "compose",
                RECIPE,
                "--out",
                str(ema_run),
                *FAST,
                "--resume",
                "--set",
                "train.iterations=3",
                "--set",
                "train.checkpoint_every=1",
                "--set",
                "train.ema_decay=0.5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"iter_000002 is not complete ({why}" in out and "from iter_000001 (iteration 1)" in out
    assert not (ema_run / "elsewhere.safetensors").is_symlink()


def test_an_ema_checkpoint_without_its_ema_file_is_refused_unless_no_ema(ema_run, tmp_path, capsys):
    checkpoint = ema_run / "checkpoints" / "iter_000002"
    (checkpoint / "ema.safetensors").unlink()
    prompts = tmp_path / "p.txt"
    prompts.write_text("target 1 1\n")
    why = (
        f"{checkpoint} is not a valid checkpoint: ema.safetensors is missing, and its run keeps an EMA "
        f"(train.ema_decay 0.5); pass --no-ema"
    )
    # before: the raw weights sampled silently as if they were the EMA's
    assert (
        cli.main(["sample", "--checkpoint", str(checkpoint), "--prompts", str(prompts), "--out", str(tmp_path / "s")])
        == 2
    )
    assert cli.main(["export", str(checkpoint), "--out", str(tmp_path / "e")]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 2 and all(why in line for line in lines), lines
    assert (
        cli.main(
            [
                "sample",
                "--checkpoint",
                str(checkpoint),
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "s"),
                "--no-ema",
            ]
        )
        == 0
    )
    assert (
        cli.main(["export", str(checkpoint), "--out", str(tmp_path / "e"), "--no-ema"]) == 2
    )  # the export holds EMA weights
    assert "vector" in error_lines(capsys)[0]


def test_sample_no_ema_samples_the_raw_weights(ema_run, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("target 1 1\n")
    last = str(ema_run / "checkpoints" / "last")
    runs = {}
    for name, flags in (("ema", []), ("raw", ["--no-ema"])):
        assert (
            cli.main(
                [
                    "sample",
                    "--checkpoint",
                    last,
                    "--prompts",
                    str(prompts),
                    "--n",
                    "2",
                    "--out",
                    str(tmp_path / name),
                    *flags,
                ]
            )
            == 0
        )
        runs[name] = torch.load(tmp_path / name / "00000_00.pt")
    assert not torch.equal(runs["ema"], runs["raw"])


def test_export_copies_a_whole_export_and_nothing_else(ema_run, tmp_path, capsys):
    out = tmp_path / "exported"
    assert cli.main(["export", str(ema_run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["pytorch_lora_weights.safetensors"]
    assert "exported" in capsys.readouterr().out


def test_export_and_sample_out_must_be_a_new_folder_outside_checkpoints(ema_run, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("target 1 1\n")
    checkpoint = ema_run / "checkpoints" / "iter_000002"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    earlier = tmp_path / "earlier"
    assert (
        cli.main(
            ["sample", "--checkpoint", str(checkpoint), "--prompts", str(prompts), "--n", "2", "--out", str(earlier)]
        )
        == 0
    )
    capsys.readouterr()
    before = (
        snapshot(ema_run) | {"file": a_file.read_text()} | {f"earlier/{k}": v for k, v in snapshot(earlier).items()}
    )
    long = tmp_path / ("o" * 300)
    cases = {
        str(a_file): f"--out: {a_file} is a file; expected a new or empty folder",
        str(
            checkpoint / "samples"
        ): f"--out: {checkpoint / 'samples'} is inside the checkpoint {checkpoint}; choose a folder outside it",
        str(checkpoint): f"--out: {checkpoint} is inside the checkpoint {checkpoint}",
        str(
            ema_run / "checkpoints" / "mine"
        ): f"--out: {ema_run / 'checkpoints' / 'mine'} is inside the checkpoints of the run {ema_run}",
        str(
            earlier
        ): f"--out: {earlier} exists and is not empty; choose a new folder",  # before: overwritten, one file orphaned
        str(long): f"--out: cannot create {long}: File name too long",
    }
    for target, message in cases.items():
        assert (
            cli.main(["export", str(checkpoint), "--out", target]) == 2
        )  # before: NotADirectoryError traceback (a file)
        assert cli.main(["sample", "--checkpoint", str(checkpoint), "--prompts", str(prompts), "--out", target]) == 2
        lines = error_lines(capsys)
        assert len(lines) == 2 and all(f"error: {message}" in line for line in lines), (target, lines)
    assert (
        snapshot(ema_run) | {"file": a_file.read_text()} | {f"earlier/{k}": v for k, v in snapshot(earlier).items()}
        == before
    )


# --- the run folder's own paths -------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("small") / "run"
    assert cli.main(["compose", RECIPE, "--out", str(out), *FAST, "--set", "train.iterations=1"]) == 0
    return out


@pytest.fixture
def small_run(small_base, tmp_path) -> Path:
    return Path(shutil.copytree(small_base, tmp_path / "run", symlinks=True))


def test_last_as_a_real_folder_is_refused_before_anything_runs(small_run, capsys):
    last = small_run / "checkpoints" / "last"
    last.unlink()
    last.mkdir()
    (last / "mine.txt").write_text("mine")
    before = snapshot(small_run)
    # before: found at the first checkpoint write, after the training (IsADirectoryError traceback)
    assert (
        cli.main(["compose", RECIPE, "--out", str(small_run), *FAST, "--resume", "--set", "train.iterations=2"]) == 2
    )
    lines = error_lines(capsys)
    assert lines == [
        f"error: --resume: {last} is a folder where fgrpo keeps its link to the newest checkpoint; "
        "move it away (nothing was written)"
    ]
    assert snapshot(small_run) == before


@pytest.mark.parametrize(
    "name", ["checkpoints", "metrics.jsonl", "samples", "tensorboard", "recipe.resolved.yaml", ".fgrpo.lock"]
)
def test_resume_writes_through_no_link(small_run, tmp_path, name, capsys):
    target = tmp_path / "elsewhere"
    real = small_run / name
    if real.exists():
        shutil.move(real, target)
    elif name in ("samples", "tensorboard"):
        target.mkdir()
    else:
        target.write_text("")
    real.symlink_to(target)
    around = snapshot(tmp_path / "elsewhere") if target.is_dir() else target.read_bytes()
    assert (
        cli.main(["compose", RECIPE, "--out", str(small_run), *FAST, "--resume", "--set", "train.iterations=2"]) == 2
    )
    lines = error_lines(capsys)
    assert lines == [
        f"error: --resume: {real} is a link; fgrpo reads and writes a run folder's own files only, never "
        "through links (replace the link by what it points to)"
    ], lines
    assert (snapshot(target) if target.is_dir() else target.read_bytes()) == around


def test_last_pointing_out_of_the_run_is_not_followed(small_run, tmp_path, capsys):
    other = tmp_path / "other"
    assert (
        cli.main(["compose", RECIPE, "--out", str(other), *FAST, "--set", "train.iterations=1", "--set", "seed=5"])
        == 0
    )
    last = small_run / "checkpoints" / "last"
    last.unlink()
    last.symlink_to(other / "checkpoints" / "iter_000001")
    prompts = tmp_path / "p.txt"
    prompts.write_text("target 1 1\n")
    assert (
        cli.main(["sample", "--checkpoint", str(last), "--prompts", str(prompts), "--out", str(tmp_path / "s")]) == 2
    )
    assert cli.main(["export", str(last), "--out", str(tmp_path / "e")]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 2 and all(
        f"{last} points to {other / 'checkpoints' / 'iter_000001'}, which is not a checkpoint of" in ln for ln in lines
    ), lines
    # a run folder given as --checkpoint finds its own newest checkpoint, whatever `last` says
    assert (
        cli.main(["sample", "--checkpoint", str(small_run), "--prompts", str(prompts), "--out", str(tmp_path / "s")])
        == 0
    )


def test_a_finished_run_resumed_reads_nothing_through_a_planted_last(small_run, tmp_path, capsys, monkeypatch):
    # a resume with nothing left to train ends with the warnings about the weights it hands over:
    # before, they were read from whatever checkpoints/last pointed to (its state.json outside the run)
    away = Path(shutil.copytree(small_run / "checkpoints" / "iter_000001", tmp_path / "away"))
    last = small_run / "checkpoints" / "last"
    last.unlink()
    last.symlink_to(away)
    OpenAudit.install()
    monkeypatch.setattr(OpenAudit, "hits", [])
    monkeypatch.setattr(OpenAudit, "forbidden", str(away.resolve()))
    assert (
        cli.main(["compose", RECIPE, "--out", str(small_run), *FAST, "--resume", "--set", "train.iterations=1"]) == 0
    )
    monkeypatch.setattr(OpenAudit, "forbidden", None)
    assert OpenAudit.hits == []
    assert error_lines(capsys) == []


def test_a_recipe_named_dots_writes_its_run_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("...yaml", "..yaml"):
        shutil.copy(RECIPE, tmp_path / name)
        assert cli.main(["compose", name, *FAST, "--set", "train.iterations=1"]) == 0
    # before: runs/../<date-time>, outside runs/
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["..yaml", "...yaml", "runs"])
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["recipe"]


def test_compose_out_too_long_a_name_is_one_line(tmp_path, capsys):
    long = tmp_path / ("r" * 300)
    assert (
        cli.main(["compose", RECIPE, "--out", str(long), *FAST, "--set", "train.iterations=1"]) == 2
    )  # before: OSError traceback
    assert error_lines(capsys) == [f"error: --out: cannot create {long}: File name too long"]
