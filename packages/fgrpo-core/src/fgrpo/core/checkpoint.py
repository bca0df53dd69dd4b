"""Atomic checkpoints: a folder is written under a temporary name, then renamed; ``last`` is a
symlink replaced atomically, so a kill at any moment never leaves a half checkpoint as ``last``.

Layout of ``checkpoints/iter_NNNNNN/``::

    trainable.safetensors   the policy's trainable weights (LoRA or full)
    ema.safetensors         their EMA, when enabled
    old.safetensors         the objective's old policy (a lagged copy of them), when it keeps one
    optimizer.pt            optimizer and LR-schedule state (tensors and numbers only)
    rng-rankR.pt            each process's torch RNG states
    state.json              iteration, sampler state, data position, the resolved recipe, run id
    export/                 the trained weights in the backbone's own format, when the policy
                            writes them (a LoRA as diffusers' save_lora_weights does)
Loading uses ``torch.load(weights_only=True)`` and safetensors: nothing arbitrary is unpickled; a
file that does not read back raises :class:`CheckpointError` (one line, "not a valid checkpoint").

Only names this module creates are ever deleted (``iter_NNNNNN`` written by the same run, its own
``.tmp-iter_NNNNNN-PID`` folders), never through a link: a user's ``iter_000004-best`` copy, a
``.tmp-mine`` folder or a checkpoint of another run in the same folder stays. An existing folder
of the name about to be written is set aside (renamed), never overwritten.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from fgrpo.core import confine, runread
from fgrpo.core.config import first_line
from fgrpo.core.confine import file_mode
from fgrpo.core.registry import ComponentError

TRAINABLE = "trainable.safetensors"
EMA = "ema.safetensors"
OLD = "old.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "state.json"
EXPORT = "export"
BEST = "best"  # a link like last: the checkpoint of the best gold metric (eval.guard)
# recipe keys that may differ on resume (fnmatch patterns): extending a run, how it is shown,
# how long to wait for a reward or for the other processes
RESUMABLE_CHANGES = (
    "train.iterations",
    "log.*",
    "train.process_group_timeout_s",
    "reward.*.timeout_s",
)
ITER_NAME = re.compile(r"iter_(\d{6,})")
TMP_NAME = re.compile(r"\.tmp-iter_\d{6,}-\d+")
LAST_TMP_NAME = re.compile(r"\.last-\d+")


class CheckpointError(ComponentError):
    """A checkpoint folder or file that does not read back: ``str()`` is one line for the user."""


def folder_name(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def iteration_of(path: Path) -> int | None:
    """N of a folder named exactly ``iter_NNNNNN`` (None for any other name)."""
    match = ITER_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    path.chmod(file_mode())


def share_files(folder: Path) -> None:
    """Give every file under ``folder`` :func:`file_mode`: safetensors (and libraries that write
    through it: diffusers, peft) create files 0600, which team-mates on a shared cluster cannot
    read, while everything else a run writes follows the umask."""
    mode = file_mode()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink() and (path.stat().st_mode & 0o777) != mode:
            path.chmod(mode)


def write(
    root: Path,
    iteration: int,
    *,
    trainable: Mapping[str, torch.Tensor],
    ema: Mapping[str, torch.Tensor] | None,
    optimizer: Mapping[str, Any],
    old: Mapping[str, torch.Tensor] | None = None,
    rng: Mapping[int, Any],
    state: Mapping[str, Any],
    keep: int,
    export: Callable[[str], Any] | None = None,
) -> Path:
    """Write checkpoint ``iteration`` under ``root`` (checkpoints/) and point ``last`` at it; then
    prune the older checkpoints of the same run (``state["run_id"]``) down to ``keep``.
    ``export(folder)`` writes extra files into ``export/`` before the folder becomes visible."""
    final = root / folder_name(iteration)
    tmp = root / f".tmp-{folder_name(iteration)}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.is_symlink():
            tmp.unlink()
        elif tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_tensors(trainable, tmp / TRAINABLE)
        if ema is not None:
            save_tensors(ema, tmp / EMA)
        if old is not None:
            save_tensors(old, tmp / OLD)
        _save_torch(dict(optimizer), tmp / OPTIMIZER)
        for rank, states in rng.items():
            _save_torch(states, tmp / f"rng-rank{rank}.pt")
        (tmp / STATE).write_text(json.dumps(dict(state), indent=1, sort_keys=True))
        if export is not None:
            export(str(tmp / EXPORT))
            if (tmp / EXPORT).is_dir():
                share_files(tmp / EXPORT)
                confine.fsync_tree(tmp / EXPORT)
        confine.fsync_tree(tmp)
        if final.is_symlink() or final.exists():  # not this run's (resume starts past its own)
            set_aside(final)
        os.replace(tmp, final)
        _point_last(root, final.name)
        confine.fsync_dir(root)
    except (OSError, RuntimeError, SafetensorError) as exc:  # a full disk, a quota, a file-size limit
        shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc, 200)
        raise CheckpointError(
            f"cannot write the checkpoint of iteration {iteration} ({root}): {reason}; the checkpoints written "
            "before it are kept (--resume continues from the newest)"
        ) from None
    prune(root, keep, state.get("run_id"))
    return final


class _Recording:
    """A file whose write errors are kept: torch.save reports a failed write as "unexpected pos"
    (a RuntimeError), which hides the reason (a full disk, a file-size limit)."""

    def __init__(self, fh: Any):
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def _save_torch(obj: Any, path: Path) -> None:
    with path.open("wb") as fh:
        recording = _Recording(fh)
        try:
            # torch.save only writes to and flushes a file object: _Recording is one, not an IO subclass
            torch.save(obj, recording)  # type: ignore[arg-type]
        except RuntimeError:
            if recording.error is not None:
                raise recording.error from None
            raise


def set_aside(path: Path) -> Path:
    """Rename ``path`` to ``<name>.set-aside-K`` (the first free K): kept, out of the way."""
    k = 1
    while (aside := path.with_name(f"{path.name}.set-aside-{k}")).exists() or aside.is_symlink():
        k += 1
    os.replace(path, aside)
    return aside


def _point_last(root: Path, name: str, link_name: str = "last") -> None:
    link = root / link_name
    tmp_link = root / f".last-{os.getpid()}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    os.symlink(name, tmp_link)
    if link.exists() and not link.is_symlink():  # not ours (a user's folder named best): kept
        set_aside(link)
    os.replace(tmp_link, link)


def point_best(root: Path, name: str) -> None:
    """``best`` -> checkpoint ``name`` (the over-optimisation guard's best gold value); pruning
    never deletes what ``best`` names."""
    _point_last(root, name, BEST)


def _is_real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def prune(root: Path, keep: int, run_id: str | None) -> None:
    """Keep the ``keep`` newest complete checkpoints of run ``run_id`` (and whatever ``last``
    names); delete the older ones of that run and this run's leftover temporary folders. Nothing
    else: not another run's checkpoints, not a name this module does not create, not a link."""
    if run_id is None:
        return
    named = {(root / link).resolve() for link in ("last", BEST) if (root / link).is_symlink()}
    mine = [p for p in complete(root) if _run_id(p) == run_id]
    for old in mine[:-keep] if keep else mine:
        if old.resolve() not in named:
            shutil.rmtree(old)
    for item in root.iterdir():
        if TMP_NAME.fullmatch(item.name) and _is_real_dir(item):
            shutil.rmtree(item)  # an interrupted write: the folder is locked, so nobody else's
        elif LAST_TMP_NAME.fullmatch(item.name) and item.is_symlink():
            item.unlink()


def _run_id(folder: Path) -> str | None:
    try:
        state = runread.read_state(folder / STATE, what=str(folder / STATE))
    except runread.Unreadable:
        return None
    return state.get("run_id")


# --- which folders are complete checkpoints ----------------------------------------------------


_safetensors_problem = runread.safetensors_problem
_torch_file_problem = runread.torch_file_problem


def problem(folder: Path, *, ema: bool = True) -> str | None:
    """Why ``folder`` is not a complete checkpoint; None when every file it holds reads back
    (``export/`` included) and none is a link or anything but a regular file. ``ema``: a checkpoint
    of a run that keeps an EMA must hold its EMA file (``fgrpo export/sample --no-ema`` do not ask).
    Resume, ``fgrpo export`` and ``fgrpo sample`` all use this one check."""
    if not folder.is_dir():
        return "not a folder"
    odd = confine.links_below(folder)
    if odd:
        path, why = odd[0]
        return f"{path.relative_to(folder)} {why}" + (
            " (its files are read where they are, never through links)" if why == "is a link" else ""
        )
    try:
        state = runread.read_json(folder / STATE, what=STATE)
    except runread.Unreadable as exc:
        return str(exc)
    wrong = runread.state_problem(state)
    if wrong is not None:
        return f"{STATE} {wrong}"
    files = [
        _safetensors_problem(folder / TRAINABLE),
        _torch_file_problem(folder / OPTIMIZER),
        _torch_file_problem(folder / "rng-rank0.pt"),
    ]
    decay = ema_decay(state)
    if (folder / EMA).exists():
        files.append(_safetensors_problem(folder / EMA))
    elif ema and decay > 0:
        files.append(f"{EMA} is missing, and its run keeps an EMA (train.ema_decay {decay:g})")
    if (folder / OLD).exists():
        files.append(_safetensors_problem(folder / OLD))
    files += _export_problems(folder / EXPORT)
    return next((p for p in files if p is not None), None)


def ema_decay(state: Mapping[str, Any]) -> float:
    train = state.get("recipe", {}).get("train")
    decay = train.get("ema_decay", 0.0) if isinstance(train, Mapping) else 0.0
    return float(decay) if isinstance(decay, (int, float)) and not isinstance(decay, bool) else 0.0


def _export_problems(export: Path) -> list[str | None]:
    """The safetensors and JSON files of ``export/`` must read back (a file cut by a full disk or a
    copy does not)."""
    if not export.is_dir():
        return []
    found: list[str | None] = []
    for path in sorted(p for p in export.rglob("*") if p.is_file()):
        name = str(path.relative_to(export.parent))
        if path.suffix == ".safetensors":
            found.append(_safetensors_problem(path, name))
        elif path.suffix == ".json":
            try:
                runread.read_json(path, what=name)
            except runread.Unreadable:
                found.append(f"{name} is not valid JSON")
    return found


def verify(folder: Path, *, ema: bool = True) -> None:
    """:class:`CheckpointError` (one line) unless :func:`problem` finds ``folder`` complete: what
    ``fgrpo export`` and ``fgrpo sample`` check before copying or sampling anything."""
    why = problem(folder, ema=ema)
    if why is not None:
        hint = "; pass --no-ema for the raw trained weights" if why.startswith(f"{EMA} is missing") else ""
        raise CheckpointError(f"{folder} is not a valid checkpoint: {why}{hint}")


def _numbered(root: Path) -> list[Path]:
    """The real folders named ``iter_NNNNNN`` under ``root``, oldest first."""
    found = [(n, p) for p in root.iterdir() if (n := iteration_of(p)) is not None and _is_real_dir(p)]
    return [p for _, p in sorted(found, key=lambda pair: pair[0])]


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first: real folders named ``iter_NNNNNN``."""
    if not root.is_dir():
        return []
    return [p for p in _numbered(root) if problem(p) is None]


def newest(root: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint under ``root`` (whatever ``last`` says: it may be missing,
    dangling or behind after a kill), and the newer ``iter_NNNNNN`` folders that are not complete,
    each with why."""
    if not root.is_dir():
        return None, []
    found = _numbered(root)
    skipped: list[tuple[Path, str]] = []
    for folder in reversed(found):
        why = problem(folder)
        if why is None:
            return folder, skipped[::-1]
        skipped.append((folder, why))
    return None, skipped[::-1]


def last_of(root: Path) -> Path | None:
    """The checkpoint ``root/last`` names, when it is what fgrpo writes: a link to a sibling
    ``iter_NNNNNN`` folder (a link elsewhere, or through another link, names nothing)."""
    link = root / "last"
    if not link.is_symlink():
        return None
    target = os.readlink(link)
    folder = root / target
    return folder if ITER_NAME.fullmatch(target) and _is_real_dir(folder) else None


def last_complete(root: Path) -> Path | None:
    """The checkpoint ``root/last`` names (:func:`last_of`) when it is complete (:func:`problem`,
    its EMA file not asked for): what the run hands over, read for its weight warnings by the
    report and at the end of ``compose``. Nothing outside the run, nor through a link, is read."""
    last = last_of(root)
    return last if last is not None and problem(last, ema=False) is None else None


def latest(root: Path) -> Path | None:
    return newest(root)[0]


# --- reading -----------------------------------------------------------------------------------


def read_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's ``state.json``, its types checked (:func:`fgrpo.core.runread.read_state`)."""
    path = folder / STATE
    try:
        return runread.read_state(path, what=STATE)
    except runread.Unreadable as exc:
        raise CheckpointError(f"{folder} is not a valid checkpoint: {exc}") from None


def read_tensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    try:
        return runread.read_safetensors(path, str(device), what=f"{path.parent} is not a valid checkpoint")
    except runread.Unreadable as exc:
        raise CheckpointError(str(exc)) from None


def read_torch(path: Path) -> Any:
    try:
        return runread.read_torch(path, what=f"{path.parent} is not a valid checkpoint")
    except runread.Unreadable as exc:
        raise CheckpointError(str(exc)) from None


def recipe_differences(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    only: Sequence[str] = ("*",),
    ignore: Sequence[str] = RESUMABLE_CHANGES,
) -> list[str]:
    """``key: a in the checkpoint, b now`` for every dotted key whose value differs between two
    resolved recipes, among the keys matching a pattern of ``only`` and none of ``ignore``."""
    diffs: list[str] = []

    def matches(key: str, patterns: Sequence[str]) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for key in sorted(set(a) | set(b), key=str):
                walk(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{prefix}.{key}" if prefix else str(key))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                walk(x, y, f"{prefix}.{i}")
        elif a != b and matches(prefix, only) and not matches(prefix, ignore):
            diffs.append(f"{prefix}: {a!r} in the checkpoint, {b!r} now")

    walk(saved, current, "")
    return diffs
