"""Run folders: one writer each, checks before writes, nothing lost or mixed.

A run folder (``--out DIR``; by default ``runs/<recipe>/<date-time>``, made unique) holds::

    .fgrpo.lock            locked (flock) by the process training into the folder, for its life
    recipe.resolved.yaml   the validated recipe, every default written out
    metrics.jsonl          one JSON object per iteration
    tensorboard/  samples/  curves.png  report.html
    checkpoints/iter_NNNNNN/  checkpoints/last

:func:`claim` opens a folder for a run: it takes the lock (a second writer is refused, naming the
holder's PID; the kernel drops the lock when its process dies, ``kill -9`` included), decides
whether the run is new, resumed from the newest complete checkpoint or started over, and checks
the recipe against that checkpoint, all before anything is written. docs/run-folders.md has the
rules for users.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import attrs

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import confine, stages, yaml_reading
from fgrpo.core import recipe as recipe_mod
from fgrpo.core.config import ConfigError, RecipeError
from fgrpo.core.recipe import Recipe
from fgrpo.core.runlog import METRICS

LOCK = ".fgrpo.lock"
RECIPE_FILE = "recipe.resolved.yaml"
#: names whose presence makes a folder a run folder (what a run writes)
RUN_FILES = frozenset(
    {RECIPE_FILE, METRICS, "checkpoints", "tensorboard", "samples", "curves.png", "report.html", stages.FOLDER}
)
NEW, RESUME, START_OVER = "new", "resume", "start-over"
#: what decides the sampled policy: ``fgrpo sample`` refuses a recipe that differs from the
#: checkpoint's in these (where it runs and in which dtype may differ)
POLICY_KEYS = ("seed", "model.*", "train.ema_decay")
RUNTIME_KEYS = ("model.device", "model.dtype")


def _refuse(key: str, message: str) -> RecipeError:
    return RecipeError([ConfigError(key, message)])


# --- the lock ----------------------------------------------------------------------------------


class FolderLock:
    """An exclusive ``flock`` on ``FOLDER/.fgrpo.lock``. flock locks belong to the open file, so the
    kernel releases this one when the process ends, however it ends; the file keeps the holder's
    PID and host for the message that refuses a second writer."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 256, 0).decode(errors="replace").split()
                os.close(fd)
                raise _busy(self.path.parent, holder) from None
            # the holder we waited for may have removed the folder it created: lock the live file
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
                self._fd = fd
                return
            os.close(fd)
            self.path.parent.mkdir(parents=True, exist_ok=True)
        raise _refuse("--out", f"{self.path.parent}: could not take its lock ({LOCK} keeps changing)")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def _busy(folder: Path, holder: list[str]) -> RecipeError:
    who = "process unknown"
    if holder:
        who = f"process {holder[0]}"
        if len(holder) > 1 and holder[1] != socket.gethostname():
            who += f" on host {holder[1]}"
    return _refuse("--out", f"{folder} is in use by another run ({who}); wait for it to end or choose another --out")


# --- claiming a folder -------------------------------------------------------------------------


@attrs.define
class RunFolder:
    """A run folder this process holds the lock of, and what the run does with it."""

    path: Path
    lock: FolderLock
    created: bool  # this process made the folder (removed again if the run never starts)
    run_id: str  # written into every checkpoint; pruning only touches this run's
    resume_from: Path | None = None
    skipped: list[tuple[Path, str]] = attrs.Factory(list)  # newer checkpoints that are not complete
    started_over: bool = False
    #: what the folder held when it was claimed: a run that never starts removes only what it added
    held: frozenset[str] = attrs.field(
        default=attrs.Factory(lambda self: frozenset(p.name for p in self.path.iterdir()), takes_self=True)
    )

    def write_recipe(self, recipe: Recipe) -> None:
        confine.write_atomic(self.path / RECIPE_FILE, recipe.to_yaml())

    def release(self) -> None:
        self.lock.release()

    def abandon(self) -> None:
        """The run did not start: let go of the folder, leaving it as it was. What the start added
        goes (a tracker that failed leaves its folder, ``tensorboard/``, behind it), then the lock
        file when nothing else is there, then the folder when this process made it; what the folder
        held before is never touched."""
        for added in sorted(p for p in self.path.iterdir() if p.name not in self.held | {LOCK}):
            if added.is_dir() and not added.is_symlink():
                shutil.rmtree(added, ignore_errors=True)
            else:
                added.unlink(missing_ok=True)
        self.lock.release()
        if {p.name for p in self.path.iterdir()} <= {LOCK}:
            (self.path / LOCK).unlink(missing_ok=True)  # a waiting opener notices (FolderLock.acquire)
            if self.created:
                try:
                    self.path.rmdir()
                except OSError:
                    pass


def claim(recipe: Recipe, out: str | Path | None, mode: str = NEW) -> RunFolder:
    """Lock the run folder and decide how the run uses it; raises RecipeError (nothing written
    but the lock file) when the folder is in use, is not a run folder, holds a run that ``mode``
    must not touch, or holds a checkpoint whose recipe differs."""
    if out is None:
        if mode != NEW:
            raise _refuse(f"--{mode}", "needs --out DIR: the run folder to continue")
        return _claim_default(recipe)
    folder = Path(out)
    created = _make(folder)
    _holds_run(folder)  # refuses a folder that is not a run's before the lock file is made in it
    _writes_inside(folder, "--out" if mode == NEW else f"--{mode}")
    lock = FolderLock(folder)
    try:
        lock.acquire()
    except PermissionError as exc:
        raise _refuse("--out", f"cannot write to {folder}: {exc.strerror}") from None
    except OSError as exc:
        raise _refuse("--out", f"cannot lock {folder}: {exc.strerror}") from None
    claimed = RunFolder(folder, lock, created, run_id=uuid.uuid4().hex)
    try:
        _decide(claimed, recipe, mode)
    except BaseException:
        claimed.abandon()
        raise
    return claimed


def _make(folder: Path) -> bool:
    try:
        if folder.exists() and not folder.is_dir():
            raise _refuse("--out", f"{folder} is a file, not a folder")
        folder.mkdir(parents=True)
        return True
    except FileExistsError:
        if not folder.is_dir():
            raise _refuse("--out", f"{folder} is a file, not a folder") from None
        return False
    except OSError as exc:
        raise _refuse("--out", f"cannot create {folder}: {exc.strerror}") from None


def _writes_inside(folder: Path, key: str) -> None:
    """Refuse a run folder whose run would write outside it: a link among the names a run writes
    (checkpoints, metrics.jsonl ..., the lock file) or under samples/ and tensorboard/; and a real
    ``checkpoints/last``, where the run keeps its link to the newest checkpoint (else found only at
    the first checkpoint write, hours into the run). Nothing is written before."""
    for name in sorted(RUN_FILES | {LOCK}):
        if (folder / name).is_symlink():
            raise _refuse(key, confine.link_message(folder / name))
    for name in ("samples", "tensorboard"):
        if (folder / name).is_dir():
            for path, why in confine.links_below(folder / name):
                raise _refuse(
                    key,
                    confine.link_message(path)
                    if why == "is a link"
                    else f"{path} {why}; a run writes only plain files",
                )
    last = folder / "checkpoints" / "last"
    if last.exists() and not last.is_symlink():
        kind = "folder" if last.is_dir() else "file"
        raise _refuse(
            key,
            f"{last} is a {kind} where fgrpo keeps its link to the newest checkpoint; move it away (nothing was "
            f"written)",
        )


def default_folder(recipe: Recipe) -> Path:
    """runs/<recipe>/<date-time>: the base name of a new default folder (a recipe named ``...yaml``
    or ``..yaml`` stays under runs/: its name is not a path)."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(recipe.source).stem).strip(".")
    return Path("runs") / (stem or "recipe") / time.strftime("%Y%m%d-%H%M%S")


def _claim_default(recipe: Recipe) -> RunFolder:
    folder = new_default_folder(recipe)
    lock = FolderLock(folder)
    lock.acquire()
    return RunFolder(folder, lock, True, run_id=uuid.uuid4().hex)


def new_default_folder(recipe: Recipe) -> Path:
    """A new folder per run, made: ``mkdir`` is atomic, so two runs started in the same second take
    ``<date-time>`` and ``<date-time>-2``."""
    base = default_folder(recipe)
    for k in range(1, 1000):
        folder = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _refuse("--out", f"cannot create {folder}: {exc.strerror}") from None
        return folder
    raise _refuse("--out", f"{base}: a thousand runs started in this second; pass --out")


def _holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run; refuses a folder that holds anything else."""
    try:
        entries = sorted(p.name for p in folder.iterdir() if p.name != LOCK)
    except OSError as exc:
        raise _refuse("--out", f"cannot read {folder}: {exc.strerror}") from None
    holds_run = any(name in RUN_FILES for name in entries)
    if entries and not holds_run:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise _refuse("--out", f"{folder} is not a run folder (it holds {shown}); choose a new or empty folder")
    return holds_run


def _holds_earlier_stages_only(folder: Path) -> bool:
    """A recipe in stages (:mod:`fgrpo.core.stages`) trains its earlier stages inside the folder of
    its last one, before that one starts there."""
    return {p.name for p in folder.iterdir()} <= {stages.FOLDER, LOCK}


def _decide(claimed: RunFolder, recipe: Recipe, mode: str) -> None:
    folder = claimed.path
    if not _holds_run(folder) or _holds_earlier_stages_only(folder):
        return  # new or empty: any mode starts the run here (job scripts pass --resume every time)
    newest, skipped = ckpt.newest(folder / "checkpoints")
    claimed.skipped = skipped
    if mode == NEW:
        raise _refuse("--out", f"{folder} already holds a run; pass --resume to continue it or choose another --out")
    if mode == START_OVER:
        if newest is not None:
            raise _refuse(
                "--start-over",
                f"{folder} holds complete checkpoints (the newest is {newest.name}); --resume continues "
                "them; to train from iteration 0 choose another --out",
            )
        claimed.started_over = True
        return
    if newest is None:
        why = "".join(f"; {p.name}: {reason}" for p, reason in skipped)
        raise _refuse(
            "--resume",
            f"{folder} holds a run but no complete checkpoint{why}. Pass --start-over to train it again "
            "from iteration 0 (its metrics are replaced), or choose another --out",
        )
    try:
        state = ckpt.read_state(newest)
    except ckpt.CheckpointError as exc:
        raise _refuse("--resume", str(exc)) from None
    refuse_another_recipe(state, recipe)
    claimed.resume_from = newest
    claimed.run_id = state.get("run_id") or claimed.run_id  # a checkpoint from before run ids: a new one


def refuse_another_recipe(state: dict, recipe: Recipe) -> None:
    """Refuse to go on from a checkpoint (its ``state.json``) of a recipe that differs from
    ``recipe`` in more than what a resume may change; every difference one line."""
    diffs = ckpt.recipe_differences(resolved(state["recipe"]), recipe.data)
    if diffs:
        raise RecipeError([ConfigError("--resume", f"the recipe differs from the checkpoint's: {d}") for d in diffs])


def resolved(saved: dict) -> dict:
    """A checkpoint's recipe as this version resolves it (keys added since, with their defaults);
    as saved when it no longer validates (the comparison then names what changed)."""
    recipe, _ = recipe_mod.validate(saved)
    return recipe.data if recipe is not None else saved


# --- a checkpoint outside a run: `fgrpo sample` -------------------------------------------------


def find_checkpoint(path: Path) -> Path:
    """A checkpoint folder, or the newest complete one of a run folder (or of its checkpoints/).
    A run's ``last`` is followed only to a checkpoint folder next to it (what fgrpo writes)."""
    if path.is_symlink() and path.name == "last":
        return _follow_last(path)
    if not path.exists():
        raise _refuse(
            "--checkpoint", f"{path} does not exist; expected RUN, RUN/checkpoints/iter_N or RUN/checkpoints/last"
        )
    if not path.is_dir():
        raise _refuse(
            "--checkpoint", f"{path} is a file; expected a folder: RUN, RUN/checkpoints/iter_N or RUN/checkpoints/last"
        )
    if (path / ckpt.STATE).exists():
        return path
    for root in (path / "checkpoints", path):
        newest, _ = ckpt.newest(root)
        if newest is not None:
            return newest
    raise _refuse(
        "--checkpoint",
        f"{path} holds no {ckpt.STATE}: not a checkpoint folder, nor a run folder with a complete checkpoint",
    )


def _follow_last(link: Path) -> Path:
    folder = ckpt.last_of(link.parent)
    if folder is None:
        raise _refuse(
            "--checkpoint",
            f"{link} points to {os.readlink(link)}, which is not a checkpoint of {link.parent} "
            "(fgrpo's last names a checkpoint folder next to it)",
        )
    return folder


def output_folder(path: Path, key: str = "--out") -> Path:
    """Where ``fgrpo export`` or ``fgrpo sample`` may write: absent or an empty folder, and not
    inside a checkpoint or a run's checkpoints/ (what is written there is taken for the run's)."""
    try:
        resolved = path.resolve()
        for folder in (resolved, *resolved.parents):
            if (folder / ckpt.STATE).is_file():
                raise _refuse(key, f"{path} is inside the checkpoint {folder}; choose a folder outside it")
            if folder.name == "checkpoints" and any(
                (folder.parent / name).exists() for name in (METRICS, RECIPE_FILE)
            ):
                raise _refuse(
                    key, f"{path} is inside the checkpoints of the run {folder.parent}; choose a folder outside it"
                )
        if path.exists() and not path.is_dir():
            raise _refuse(key, f"{path} is a file; expected a new or empty folder")
        if path.is_dir() and any(path.iterdir()):
            raise _refuse(key, f"{path} exists and is not empty; choose a new folder")
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _refuse(key, f"cannot create {path}: {exc.strerror}") from None
    return path


def recipe_for_checkpoint(checkpoint: Path, recipe_path: str | Path | None, overrides: Sequence[str]) -> Recipe:
    """The recipe to sample ``checkpoint`` with: its own resolved recipe (with ``overrides``), or
    the one given, which must agree with it on every key that decides the policy."""
    try:
        state = ckpt.read_state(checkpoint)
    except ckpt.CheckpointError as exc:
        raise _refuse("--checkpoint", str(exc)) from None
    saved = resolved(state["recipe"])
    if recipe_path is None:
        data, errors = yaml_reading.apply_overrides(saved, overrides)
        recipe, more = recipe_mod.validate(data, source=str(checkpoint / ckpt.STATE))
        if errors or more:
            raise RecipeError(errors + more)
        assert recipe is not None  # validate returns a recipe when it finds no error
    else:
        recipe = recipe_mod.load(recipe_path, overrides)
    conflicts = ckpt.recipe_differences(saved, recipe.data, only=POLICY_KEYS, ignore=RUNTIME_KEYS)
    if conflicts:
        raise RecipeError(
            [ConfigError("--checkpoint", f"the recipe conflicts with the checkpoint's: {c}") for c in conflicts]
        )
    return recipe
