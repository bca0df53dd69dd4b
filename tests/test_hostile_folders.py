"""Every verb that reads a run folder, against hostile forms of every file a run folder holds
(issue 50): each answers with one line and exit 2 (or exit 0, with a note where the file is
optional or an older checkpoint stands in), reads nothing outside the folder, writes nothing it
did not mean to, and ends within 10 s without holding much memory.

A run of the vector recipe (2 iterations, a checkpoint each) is made once; every case copies it
next to a secret the folder must not leak, damages one file, and runs the verbs that read it
in this process (``cli.main``). The default suite runs one form of each file; ``-m slow`` runs
every form against every verb, and each verb in its own process with its resident memory measured.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from _helpers import ROOT
from fgrpo.core import cli

RECIPE = str(ROOT / "recipes" / "vector.yaml")
QUIET = ["--quiet", "--set", "log.plots=false", "--set", "log.trackers=[]"]
PRISTINE = ["--set", "train.checkpoint_every=1"]  # the run's recipe, which a resume must repeat
SECRET = b"SECRET-50: a file outside the run folder\n"
SECONDS = 10
MEMORY = 512 << 20


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A finished run: 2 iterations, checkpoints iter_000001 and iter_000002, evaluation tiles and
    an evaluator's pictures (the vector policy makes none: written here as evaluation writes them)."""
    run = tmp_path_factory.mktemp("pristine") / "run"
    code = cli.main(
        [
            "compose",
            RECIPE,
            "--out",
            str(run),
            *QUIET,
            "--set",
            "train.iterations=2",
            "--set",
            "train.checkpoint_every=1",
        ]
    )
    assert code == 0
    png = _png()
    for kind, folder in (("eval", run / "samples" / "eval_000002"), ("gold", run / "samples" / "gold_000002" / "x")):
        folder.mkdir(parents=True)
        (folder / "00.png").write_bytes(png)
        (folder / "index.json").write_text(json.dumps([{"file": "00.png", "prompt": f"{kind} p", "score": 1.0}]))
    return run


def _png() -> bytes:
    from io import BytesIO

    from PIL import Image

    buffer = BytesIO()
    Image.new("RGB", (4, 4), "red").save(buffer, format="PNG")
    return buffer.getvalue()


# --- hostile forms: (what the folder holds, how it is damaged) ------------------------------------

NEWEST = "checkpoints/iter_000002"
ALIAS_BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
    + "model: {name: *j}\n"
)


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _link(path: Path, target: Path | str) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.symlink_to(target)


def _edit_json(path: Path, change: Callable[[object], object]) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def _flip_header(path: Path, change: Callable[[dict], None]) -> None:
    """Rewrite a safetensors header (same length, padded with spaces) as a bit flip would leave it."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()  # as safetensors writes it
    assert len(text) <= n, "the change must not lengthen the header"
    path.write_bytes(data[:8] + text.ljust(n) + data[8 + n :])


def _first_tensor(header: dict) -> dict:
    return next(v for k, v in sorted(header.items()) if k != "__metadata__")


def _shape_flip(header: dict) -> None:
    entry = _first_tensor(header)
    entry["shape"][0] = max(entry["shape"][0] - 1, 0)


def _dtype_flip(header: dict) -> None:
    _first_tensor(header)["dtype"] = "F64"


def _with_export(run: Path) -> Path:
    """The newest checkpoint given an export/ (as a LoRA run writes one), its adapter then damaged."""
    export = run / NEWEST / "export"
    export.mkdir()
    shutil.copy(run / NEWEST / "trainable.safetensors", export / "adapter_model.safetensors")
    (export / "adapter_config.json").write_text('{"r": 4}')
    return export / "adapter_model.safetensors"


class Evil:  # pickled into optimizer.pt: torch.load(weights_only=True) must refuse it
    def __reduce__(self):
        return (os.system, ("echo pwned",))


FORMS: dict[str, Callable[[Path, Path], None]] = {
    # metrics.jsonl
    "metrics_fifo": lambda run, out: _fifo(run / "metrics.jsonl"),
    "metrics_dev_zero": lambda run, out: _link(run / "metrics.jsonl", "/dev/zero"),
    "metrics_link_out": lambda run, out: _link(run / "metrics.jsonl", out / "secret.txt"),
    "metrics_huge_integer": lambda run, out: (run / "metrics.jsonl").write_text(
        '{"iteration": 1, "reward_mean": ' + "9" * 400 + "}\n"
    ),
    "metrics_not_rows": lambda run, out: (run / "metrics.jsonl").write_text('[1, 2]\n"x"\n{"iteration": true}\n'),
    # recipe.resolved.yaml
    # str() of model.name, which the report shows, would make 9**10 strings (before: MemoryError)
    "recipe_alias_bomb": lambda run, out: (run / "recipe.resolved.yaml").write_text(ALIAS_BOMB),
    "recipe_tag": lambda run, out: (run / "recipe.resolved.yaml").write_text("seed: !!python/name:os.system\n"),
    "recipe_fifo": lambda run, out: _fifo(run / "recipe.resolved.yaml"),
    "recipe_dev_zero": lambda run, out: _link(run / "recipe.resolved.yaml", "/dev/zero"),
    # an evaluation's index of tiles
    "tile_absolute": lambda run, out: _edit_json(
        run / "samples/eval_000002/index.json", lambda t: [{**t[0], "file": str(out / "secret.txt")}]
    ),
    "tile_dotdot": lambda run, out: _edit_json(
        run / "samples/eval_000002/index.json", lambda t: [{**t[0], "file": "../../../secret.txt"}]
    ),
    "tile_link_out": lambda run, out: _link(run / "samples/eval_000002/00.png", out / "secret.txt"),
    "index_fifo": lambda run, out: _fifo(run / "samples/eval_000002/index.json"),
    "index_dev_zero": lambda run, out: _link(run / "samples/eval_000002/index.json", "/dev/zero"),
    "index_object": lambda run, out: (run / "samples/eval_000002/index.json").write_text('{"file": "00.png"}'),
    "tile_without_file": lambda run, out: _edit_json(
        run / "samples/eval_000002/index.json", lambda t: [{"prompt": "p", "score": 1}]
    ),
    "tile_huge_score": lambda run, out: (run / "samples/eval_000002/index.json").write_text(
        '[{"file": "00.png", "prompt": "p", "score": ' + "9" * 400 + "}]"
    ),
    # an evaluator's pictures (issue 50, H1 and H2)
    "gold_proc_environ": lambda run, out: _edit_json(
        run / "samples/gold_000002/x/index.json", lambda t: [{**t[0], "file": "/proc/self/environ"}]
    ),
    "gold_label_link_out": lambda run, out: _link(run / "samples/gold_000002/x", out / "elsewhere"),
    "gold_index_fifo": lambda run, out: _fifo(run / "samples/gold_000002/x/index.json"),
    "gold_index_dev_zero": lambda run, out: _link(run / "samples/gold_000002/x/index.json", "/dev/zero"),
    "gold_without_file": lambda run, out: (run / "samples/gold_000002/x/index.json").write_text('[{"score": 1}]'),
    # the newest checkpoint's state.json (H5)
    "state_iteration_true": lambda run, out: _edit_json(
        run / NEWEST / "state.json", lambda s: {**s, "iteration": True}
    ),
    "state_iteration_negative": lambda run, out: _edit_json(
        run / NEWEST / "state.json", lambda s: {**s, "iteration": -7}
    ),
    "state_iteration_1e30": lambda run, out: _edit_json(
        run / NEWEST / "state.json", lambda s: {**s, "iteration": 1e30}
    ),
    "state_huge_integer": lambda run, out: (run / NEWEST / "state.json").write_text(
        (run / NEWEST / "state.json").read_text().replace('"iteration": 2', '"iteration": ' + "9" * 400)
    ),
    "state_deep_nesting": lambda run, out: (run / NEWEST / "state.json").write_text("[" * 100_000 + "]" * 100_000),
    "state_fifo": lambda run, out: _fifo(run / NEWEST / "state.json"),
    # the newest checkpoint's weights (H4 and the fallback)
    "weights_shape_flip": lambda run, out: _flip_header(run / NEWEST / "trainable.safetensors", _shape_flip),
    "weights_dtype_flip": lambda run, out: _flip_header(run / NEWEST / "trainable.safetensors", _dtype_flip),
    "weights_link_out": lambda run, out: _link(run / NEWEST / "trainable.safetensors", out / "secret.txt"),
    "weights_dev_zero": lambda run, out: _link(run / NEWEST / "trainable.safetensors", "/dev/zero"),
    "optimizer_pickle": lambda run, out: torch.save({"evil": Evil()}, run / NEWEST / "optimizer.pt"),
    "optimizer_fifo": lambda run, out: _fifo(run / NEWEST / "optimizer.pt"),
    "export_shape_flip": lambda run, out: _flip_header(_with_export(run), _shape_flip),
    "export_dtype_flip": lambda run, out: _flip_header(_with_export(run), _dtype_flip),
    "last_link_out": lambda run, out: _link(run / "checkpoints" / "last", out / "elsewhere"),
}
#: the verbs that read each file
READERS = {
    "metrics": ("report", "resume"),
    "recipe": ("report", "resume"),
    "tile": ("report",),
    "index": ("report",),
    "gold": ("report",),
    "state": ("report", "export", "sample", "resume"),
    "weights": ("report", "export", "sample", "resume"),
    "optimizer": ("export", "resume"),
    "export": ("report", "export", "sample"),
    "last": ("report", "export", "sample", "resume"),
}
#: one form of each file for the default suite
DEFAULT = (
    "gold_index_fifo",
    "state_iteration_negative",
    "metrics_dev_zero",
    "metrics_huge_integer",
    "recipe_alias_bomb",
    "tile_absolute",
    "index_fifo",
    "gold_proc_environ",
    "state_iteration_true",
    "weights_shape_flip",
    "optimizer_pickle",
    "export_dtype_flip",
    "last_link_out",
)


def verb_args(verb: str, run: Path, tmp: Path) -> list[str]:
    if verb == "report":
        return ["report", str(run)]
    if verb == "export":
        return ["export", str(run), "--out", str(tmp / "exported")]
    if verb == "sample":
        (tmp / "prompts.txt").write_text("target 1 1\n")
        return [
            "sample",
            "--checkpoint",
            str(run),
            "--prompts",
            str(tmp / "prompts.txt"),
            "--out",
            str(tmp / "made"),
            "--n",
            "1",
        ]
    return ["compose", RECIPE, "--out", str(run), "--resume", *QUIET, *PRISTINE, "--set", "train.iterations=3"]


def cases(forms) -> list[tuple[str, str]]:
    return [(form, verb) for form in forms for verb in READERS[form.split("_", 1)[0]]]


def staged(pristine: Path, tmp: Path, form: str) -> tuple[Path, Path]:
    """A copy of the run in ``tmp/out/run`` with ``form`` applied; ``tmp/out`` holds the secret."""
    outside = tmp / "out"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "elsewhere").mkdir()
    shutil.copy(outside / "secret.txt", outside / "elsewhere" / "00.png")
    (outside / "elsewhere" / "index.json").write_text(json.dumps([{"file": "00.png", "prompt": "p", "score": 1}]))
    run = outside / "run"
    shutil.copytree(pristine, run, symlinks=True)
    (run / ".fgrpo.lock").unlink(missing_ok=True)
    FORMS[form](run, outside)
    return run, outside


def snapshot(folder: Path) -> dict[str, str]:
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.name == ".fgrpo.lock":  # the lock a claim leaves behind (it holds no data)
            continue
        if path.is_symlink():
            found[rel] = "-> " + os.readlink(path)
        elif path.is_fifo():
            found[rel] = "fifo"
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def leaks(texts: list[bytes], *folders: Path) -> list[str]:
    """Where the secret shows up, plain or base64 (as a data URI would embed it)."""
    marks = (SECRET.strip(), base64.b64encode(SECRET)[:40])
    hits = [f"output {i}" for i, text in enumerate(texts) if any(m in text for m in marks)]
    for folder in folders:
        for path in folder.rglob("*") if folder.is_dir() else []:
            if (
                path.is_file()
                and not path.is_symlink()
                and path.name != "secret.txt"
                and "elsewhere" not in path.parts
            ):
                if any(m in path.read_bytes() for m in marks):
                    hits.append(str(path))
    return hits


#: what each verb may change in the run folder when it succeeds (a resume trains on)
MAY_WRITE = {"report": ("report.html",), "export": (), "sample": ()}


def judge(
    form: str, verb: str, code: int, out: str, err: str, before: dict, after: dict, outside_before, outside_after
):
    assert "Traceback" not in out + err, err[-2000:]
    assert code in (0, 2), (code, err[-2000:])
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    if code == 2:
        assert len(errors) == 1, errors
        assert before == after, "a refused command changed the run folder"
    else:
        assert errors == []
        if verb != "resume":
            changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
            assert changed <= set(MAY_WRITE[verb]), changed
        else:  # before: "iteration": -7 resumed, retrained and wrote checkpoints/iter_-00004
            assert all(re.fullmatch(r"checkpoints/iter_\d{6,}(/.*)?|[^/]+(/.*)?", k) for k in after), sorted(after)
            assert not [k for k in after if k.startswith("checkpoints/iter_-")]
    assert outside_before == outside_after, "something outside the run folder changed"


class Reads:
    """The files outside the run folder this process opens while armed (Python's audit hooks see
    ``open`` and ``os.open``, whoever calls them): the secret's folder, /dev/zero, /etc/passwd and
    any process's environ. An open refused because the path is a link (``O_NOFOLLOW``) reads nothing."""

    armed: list[Path] = []
    hits: list[str] = []
    installed = False

    @classmethod
    def watch(cls, outside: Path, allowed: list[Path]) -> None:
        if not cls.installed:
            sys.addaudithook(cls._hook)
            cls.installed = True
        cls.armed, cls.allowed, cls.hits = [outside.resolve()], [p.resolve() for p in allowed], []

    @classmethod
    def stop(cls) -> list[str]:
        cls.armed = []
        return cls.hits

    @classmethod
    def _hook(cls, event: str, args: tuple) -> None:
        if not cls.armed or event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        given = os.fsdecode(args[0])
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        if flags & os.O_NOFOLLOW and os.path.islink(given):
            return
        real = Path(os.path.realpath(given))
        outside = any(real.is_relative_to(a) for a in cls.armed) and not any(
            real.is_relative_to(a) for a in cls.allowed
        )
        special = str(real) in ("/dev/zero", "/etc/passwd") or (
            str(real).startswith("/proc/") and real.name == "environ"
        )
        if outside or special:
            cls.hits.append(str(real))


def run_in_process(pristine: Path, tmp: Path, form: str, verb: str, capsys) -> None:
    run, outside = staged(pristine, tmp, form)
    before, outside_before = snapshot(run), {k: v for k, v in snapshot(outside).items() if not k.startswith("run/")}
    args = verb_args(verb, run, tmp)

    def too_long(signum, frame):
        raise TimeoutError(f"{verb} on {form} took over {SECONDS} s")

    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(SECONDS)
    tracemalloc.start()
    Reads.watch(outside, allowed=[run, tmp / "exported", tmp / "made", tmp / "prompts.txt"])
    try:
        code = cli.main(args)
    finally:
        read_outside = Reads.stop()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert read_outside == [], f"{verb} opened files outside the run folder"
    captured = capsys.readouterr()
    after = snapshot(run)
    outside_after = {k: v for k, v in snapshot(outside).items() if not k.startswith("run/")}
    judge(form, verb, code, captured.out, captured.err, before, after, outside_before, outside_after)
    assert peak < MEMORY, f"{peak >> 20} MiB allocated by Python"
    written = [tmp / "exported", tmp / "made"]
    assert leaks([captured.out.encode(), captured.err.encode()], run, *written) == []
    if code == 0 and verb == "export":  # "exported" is a claim: every file it wrote loads (before: H4)
        from safetensors.torch import load_file

        for path in (tmp / "exported").rglob("*.safetensors"):
            load_file(str(path))


@pytest.mark.parametrize("form, verb", cases(DEFAULT))
def test_a_hostile_folder_is_one_line_and_nothing_leaks(pristine, tmp_path, form, verb, capsys):
    run_in_process(pristine, tmp_path, form, verb, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("form, verb", cases([f for f in FORMS if f not in DEFAULT]))
def test_every_hostile_form_against_every_verb(pristine, tmp_path, form, verb, capsys):
    run_in_process(pristine, tmp_path, form, verb, capsys)


MEASURE = """
import resource, sys
from fgrpo.core import cli
code = cli.main(sys.argv[2:])
with open(sys.argv[1], "w") as fh:
    fh.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
sys.exit(code)
"""


def resident(args: list[str], tmp: Path) -> tuple[subprocess.CompletedProcess, int]:
    """The verb run in a process of its own, and its peak resident memory in bytes."""
    rss = tmp / "rss"
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(rss), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done, int(rss.read_text()) if rss.exists() else 0


#: what each verb holds resident on the intact folder (torch, the model, the libraries), measured once
BASELINE: dict[str, int] = {}


@pytest.mark.slow
@pytest.mark.parametrize("form, verb", cases(FORMS))
def test_every_verb_in_its_own_process_stays_small(pristine, tmp_path, form, verb):
    """The same cases as separate processes: a hostile file costs the verb at most 64 MiB of resident
    memory beyond what it holds on the intact folder (about 560 MiB, torch and the libraries), and
    never more than 1 GiB in all (before: 2.58 GB reading /dev/zero, 1.7 GB on an alias bomb)."""
    if verb not in BASELINE:
        intact = tmp_path / "intact"
        intact.mkdir()
        run_dir = intact / "run"
        shutil.copytree(pristine, run_dir, symlinks=True)
        BASELINE[verb] = resident(verb_args(verb, run_dir, intact), intact)[1]
    run, outside = staged(pristine, tmp_path, form)
    done, peak = resident(verb_args(verb, run, tmp_path), tmp_path)
    assert "Traceback" not in done.stderr and done.returncode in (0, 2), done.stderr[-2000:]
    assert peak <= BASELINE[verb] + (64 << 20) and peak < (1 << 30), f"{peak >> 20} MiB, {BASELINE[verb] >> 20} intact"
    assert leaks([done.stdout.encode(), done.stderr.encode()], run) == []
