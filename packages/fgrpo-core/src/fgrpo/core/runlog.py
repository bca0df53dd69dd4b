"""What a run writes as it goes: metrics.jsonl (a line per iteration) and what the terminal shows
(rich progress bars, or one plain line per iteration in a log file). Experiment trackers
(TensorBoard, wandb ...) get the same rows through accelerate: see :mod:`fgrpo.core.trackers`."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from fgrpo.core import confine, runread
from fgrpo.core.registry import ComponentError

METRICS = "metrics.jsonl"


class WriteFailed(ComponentError):
    """A file of the run could not be written (a full disk, a quota): ``str()`` is one line."""


def _plain_number(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than dropping the key
    return value


class MetricsLog:
    """Appends one JSON object per iteration; on resume, lines past the checkpoint are dropped so
    the file reads as if the run had never been interrupted (TensorBoard, through the trackers,
    is told to purge the events past it too); a new run replaces the file."""

    def __init__(self, run_dir: Path, *, resume_from: int | None = None):
        self.path = run_dir / METRICS
        if resume_from is not None:
            self._truncate_after(resume_from)
        elif self.path.exists():
            self.path.unlink()

    def _truncate_after(self, iteration: int) -> None:
        if not self.path.exists():
            return
        kept = []
        text = runread.read_bytes(self.path, limit=runread.LIMITS["metrics"], what=str(self.path))
        for line in text.decode("utf-8", "replace").splitlines():
            row = _row(line)  # None: a line cut by a kill or a full disk
            if row is not None and row["iteration"] <= iteration:
                kept.append(line)
        confine.write_atomic(self.path, "".join(f"{line}\n" for line in kept))

    def write(self, iteration: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        row = {"iteration": iteration, **{k: _plain_number(v) for k, v in metrics.items()}}
        try:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise WriteFailed(
                f"cannot append to {self.path} (iteration {iteration}): {exc.strerror}; the checkpoints written "
                "before it are kept (--resume continues from the newest)"
            ) from None
        return row

    def close(self) -> None:
        pass


def _row(line: str) -> dict[str, Any] | None:
    """A metrics row: a JSON object with an integer ``iteration``; None for anything else."""
    try:
        row = runread.loads_json(line, what=METRICS)
    except runread.Unreadable:
        return None
    ok = isinstance(row, dict) and isinstance(row.get("iteration"), int) and not isinstance(row["iteration"], bool)
    return row if ok else None


def metrics_rows(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows of ``RUN/metrics.jsonl`` and how many of its lines are not rows (a line cut by a
    kill or a full disk, or anything else); never read through a link."""
    path = confine.not_a_link(Path(run_dir) / METRICS)
    if not path.exists():
        return [], 0
    text = runread.read_bytes(path, limit=runread.LIMITS["metrics"], what=str(path)).decode("utf-8", "replace")
    lines = [line for line in text.splitlines() if line.strip()]
    rows = [row for row in map(_row, lines) if row is not None]
    return rows, len(lines) - len(rows)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return metrics_rows(run_dir)[0]


SUMMARY_KEYS = ("reward_mean", "ratio_mean", "clipfrac", "kl", "time_iteration_s")


def summary_line(iteration: int, total: int, row: Mapping[str, Any], eta: str = "") -> str:
    """One iteration's headline numbers (evaluations get their own line: :func:`evaluation_line`)
    and the time left, when known."""
    parts = [f"iter {iteration}/{total}"]
    for key in SUMMARY_KEYS:
        if key in row and isinstance(row[key], (int, float)):
            parts.append(f"{key} {row[key]:.4g}")
    return "  ".join(parts + ([f"eta {eta}"] if eta else []))


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def eta_text(seconds_per_iteration: Sequence[float], left: int, threads: Any) -> str:
    """``4:10 at 2 threads``: the iterations left at the median of the recent ones' times. A CPU
    run's pace depends on its thread count (the governor changes it when other work starts:
    :mod:`fgrpo.core.threads`), so the estimate names the count it was measured at."""
    recent = seconds_per_iteration[-10:]
    if not recent or left <= 0:
        return ""
    median = statistics.median(recent)
    at = f" at {threads} thread{'s' if threads != 1 else ''}" if isinstance(threads, int) else ""
    return f"{_clock(median * left)}{at}"


def evaluation_line(iteration: int, total: int, metrics: Mapping[str, Any], weights: str | None = None) -> str:
    """``eval at iteration 25/200 (31.2 s, EMA weights after 3 updates): reward_mean 0.45
    shapes/accuracy 0.45 ... | gold: driving-closed-loop/cl_score 0.84 ...``: every overall
    evaluation metric, then every overall gold metric (per-category ones stay in metrics.jsonl
    and the report)."""
    seconds = metrics.get("time_eval_s")
    notes = ([f"{seconds:.1f} s"] if isinstance(seconds, (int, float)) else []) + ([weights] if weights else [])
    head = f"eval at iteration {iteration}/{total}" + (f" ({', '.join(notes)})" if notes else "")
    keys = ["eval/reward_mean"] + sorted(
        k for k in metrics if k.startswith("eval/") and k.count("/") <= 2 and k != "eval/reward_mean"
    )
    parts = [f"{k[len('eval/') :]} {metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), (int, float))]
    gold = sorted(k for k in metrics if k.startswith("gold/") and k.count("/") == 2)
    golds = [f"{k[len('gold/') :]} {metrics[k]:.4g}" for k in gold if isinstance(metrics.get(k), (int, float))]
    return f"{head}: " + "  ".join(parts) + (" | gold: " + "  ".join(golds) if golds else "")


class ThreadsColumn(ProgressColumn):
    """The thread count the time left was measured at (``at 2 threads``), on the iterations' bar."""

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("at", "")))


class Display:
    """rich progress bars (iterations, and the rollout, update and evaluation of each) with the
    time left, or plain lines when not writing to a terminal (CI logs, nohup). ``quiet``: no bars
    and no line per iteration (evaluations, warnings and the end are still shown); the log level
    (:mod:`fgrpo.core.logs`) decides the rest: at warning only warnings are shown."""

    def __init__(self, console: Console, *, quiet: bool, total: int, enabled: bool = True, level: str | None = None):
        from fgrpo.core import logs

        self.console = console
        self.warnings = Console(stderr=True, quiet=console.quiet, highlight=False, soft_wrap=True)
        level = logs.current() if level is None else logs.check(level)
        self.informs = enabled and logs.LEVELS.index(level) <= logs.LEVELS.index("info")
        self.warns = enabled and logs.LEVELS.index(level) <= logs.LEVELS.index("warning")
        self.per_iteration = self.informs and not quiet
        self.quiet = quiet or not console.is_terminal or not self.informs  # no bars
        self.total = total
        self.enabled = enabled
        self.progress: Progress | None = None
        self.seconds: list[float] = []

    def __enter__(self) -> Display:
        if self.enabled and not self.quiet:
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                ThreadsColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.__enter__()
            self.iterations = self.progress.add_task("iterations", total=self.total)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def start_at(self, iteration: int) -> None:
        if self.progress is not None:
            self.progress.update(self.iterations, completed=iteration)

    @contextmanager
    def bar(self, name: str, total: int) -> Iterator[Any]:
        """A transient progress bar for one step of an iteration (rollout, update, evaluation);
        yields an ``advance(n=1)`` callable, a no-op when there are no bars."""
        if self.progress is None:
            yield lambda n=1: None
            return
        task = self.progress.add_task(f"  {name}", total=total)
        try:
            yield lambda n=1: self.progress.advance(task, n)
        finally:
            self.progress.remove_task(task)

    def iteration_done(self, iteration: int, row: Mapping[str, Any]) -> None:
        seconds = row.get("time_iteration_s")
        if isinstance(seconds, (int, float)):
            self.seconds.append(float(seconds))
        eta = eta_text(self.seconds, self.total - iteration, row.get("threads"))
        if self.progress is not None:
            self.progress.update(self.iterations, advance=1, at=eta.partition(" ")[2])
        if self.per_iteration:
            self._print(summary_line(iteration, self.total, row, eta))

    def evaluation_done(self, iteration: int, metrics: Mapping[str, Any], weights: str | None = None) -> None:
        """One line per evaluation, the one before training included, bars or not; ``weights``
        says which weights were evaluated (the EMA's or the raw ones)."""
        if metrics:
            self.say(evaluation_line(iteration, self.total, metrics, weights))

    def say(self, text: str) -> None:
        """An info line."""
        if self.informs:
            self._print(text)

    def warn(self, text: str) -> None:
        """A warning line (``warning: ...``) on stderr, shown down to ``--log-level warning``."""
        if self.warns:
            self.warnings.print(f"warning: {text}", markup=False, highlight=False)

    def _print(self, text: str) -> None:
        (self.progress.console if self.progress else self.console).print(text, markup=False, highlight=False)
