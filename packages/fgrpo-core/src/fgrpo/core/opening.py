"""Opening a run for ``fgrpo compose``: its folder claimed (locked, checked), its components built,
the newest complete checkpoint restored when resuming, and only then anything written
(:func:`open_run`); closing it (:func:`close_run`, :func:`end_process_group`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from fgrpo.core import checkpoint as ckpt
from fgrpo.core import launch, rundir, trackers
from fgrpo.core.building import build_run
from fgrpo.core.config import ConfigError, RecipeError, first_line
from fgrpo.core.recipe import Recipe
from fgrpo.core.run import Run
from fgrpo.core.runlog import MetricsLog, metrics_rows
from fgrpo.core.saving import restore


def open_run(
    recipe: Recipe,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    start_over: bool = False,
    console: Console | None = None,
    quiet: bool = False,
    extra_trackers: Sequence[Any] = (),
) -> Run:
    """The run ``fgrpo compose`` trains: its folder claimed (locked, checked), its components
    built, the newest complete checkpoint restored when resuming; only then is anything written
    (check first, write after), and its trackers started (``log.trackers`` and
    ``extra_trackers``, accelerate GeneralTracker instances). ``close_run`` (or ``finish``)
    releases the folder. ``console``: where the run's lines go (default: the terminal)."""
    console = Console(highlight=False, soft_wrap=True) if console is None else console
    mode = rundir.RESUME if resume else rundir.START_OVER if start_over else rundir.NEW
    parallel = launch.start(
        train=recipe.train, log_with=trackers.log_with(recipe.log.trackers, extra_trackers) or None
    )
    folder, out_dir, resume_from = claim_folder(parallel, recipe, out, mode)
    try:
        run = build_run(recipe, out_dir=out_dir, console=console, quiet=quiet, parallel=parallel)
        run.io.folder = folder
        if resume_from:
            run.start_iteration = run.saved_at = resume_from_checkpoint(run, resume_from)
        if folder is not None:
            start_writing(run, folder, resumed=resume_from is not None)
    except BaseException:
        if folder is not None:
            folder.abandon()
        raise
    say_where_it_starts(run, folder, resume_from, resume)
    return run


def claim_folder(
    parallel: launch.Launch, recipe: Recipe, out: str | Path | None, mode: str
) -> tuple[rundir.RunFolder | None, Path, Path | None]:
    """The run folder, claimed by the main process (None on the others), its path and the checkpoint
    to resume from, on every process."""
    folder, failure = None, None
    if parallel.is_main:
        try:
            folder = rundir.claim(recipe, out, mode)
        except RecipeError as exc:
            failure = exc
    plan = parallel.share(
        None if folder is None else (str(folder.path), folder.resume_from and str(folder.resume_from))
    )
    if failure is not None:
        raise failure
    if plan is None:
        raise RecipeError([ConfigError("--out", "the main process could not open the run folder")])
    return folder, Path(plan[0]), Path(plan[1]) if plan[1] else None


def resume_from_checkpoint(run: Run, folder: Path) -> int:
    """:func:`restore`, a checkpoint that does not fit the run refused as ``--resume``'s error."""
    try:
        return restore(run, folder)
    except ckpt.CheckpointError as exc:
        raise RecipeError([ConfigError("--resume", str(exc))]) from None
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:  # files that read but do not fit
        raise RecipeError(
            [ConfigError("--resume", f"{folder} is not a valid checkpoint of this run: {first_line(exc)}")]
        ) from None


def start_writing(run: Run, folder: rundir.RunFolder, *, resumed: bool) -> None:
    """The trackers, the resolved recipe and the metrics log of the claimed folder (main process).
    The trackers start first: one that fails to start (its options were checked at `validate`; a
    library can still refuse) is one line, and the run did not begin."""
    at = run.start_iteration if resumed else None
    if resumed:  # its rows are read (and cut after the checkpoint) below: what cannot be read refuses first
        metrics_rows(folder.path)
    try:
        trackers.start(run.accelerator, run.recipe, folder.path, resume_from=at)
    except Exception as exc:  # noqa: BLE001 - any tracker library's own error
        raise RecipeError(
            [ConfigError("log.trackers", f"a tracker could not start: {type(exc).__name__}: {first_line(exc, 300)}")]
        ) from None
    folder.write_recipe(run.recipe)
    run.io.log = MetricsLog(folder.path, resume_from=at)


def say_where_it_starts(run: Run, folder: rundir.RunFolder | None, resume_from: Path | None, resume: bool) -> None:
    if folder is not None:
        for skipped, why in folder.skipped:
            run.io.display.say(
                f"{skipped.name} is not complete ({why}): kept, set aside if the run writes its iteration again"
            )
    if resume_from:
        run.io.display.say(f"resuming {run.io.out_dir} from {resume_from.name} (iteration {run.start_iteration})")
    elif folder is not None and folder.started_over:
        run.io.display.say(f"starting {run.io.out_dir} over from iteration 0 (--start-over)")
    elif resume:
        run.io.display.say(f"nothing to resume in {run.io.out_dir}: starting from iteration 0")


def close_run(run: Run) -> None:
    """Close the metrics log and the trackers, release the run folder's lock (idempotent)."""
    if run.io.log is not None:
        run.io.log.close()
    while run.accelerator.trackers:  # not accelerate's end_training: it also ends the process group
        run.accelerator.trackers.pop().finish()
    if run.io.folder is not None:
        run.io.folder.release()


def end_process_group() -> None:
    """Leave the process group once every process has finished (a no-op in one process). A process
    that exits with the group alive can abort while gloo's threads are torn down ("terminate called
    without an active exception", exit -6), and the launcher then fails a run that had finished."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
