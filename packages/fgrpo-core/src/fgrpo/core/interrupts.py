"""Ctrl-C and SIGTERM while a run trains (:class:`Interrupts`): the first lets the iteration in
progress finish, then the trainer checkpoints it, writes the report and stops; a second stops at
once (:class:`StopNow`), keeping the last complete checkpoint.

Under several processes every one of them calls :meth:`Interrupts.agreed` once per iteration, at the
same point of the loop: a signal seen by any process stops all of them after the same iteration (a
checkpoint needs every process, and a process that left early would hang the others' collectives).
"""

from __future__ import annotations

import os
import shlex
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from fgrpo.core.launch import Launch

SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: a second signal this soon after the first may be the same Ctrl-C: a terminal sends it to the
#: launcher too, and torch's launcher passes it on to every process at once. Such a signal only
#: restores the handlers from before, so that the next one (Python's KeyboardInterrupt) stops at once
SAME_REQUEST_S = 0.5


class StopNow(KeyboardInterrupt):
    """The second signal: stop at once (a KeyboardInterrupt, so ``finally`` blocks still run)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@attrs.define
class Interrupts:
    """SIGINT and SIGTERM handlers for the time of a ``with`` block, installed in the main thread
    only (Python runs signal handlers there alone) and the previous handlers restored on exit.
    ``note``: say on stderr that the run stops after this iteration (the main process)."""

    note: bool = True
    received: int | None = None  # the first signal this process received
    stopped_by: int | None = None  # the signal every process agreed to stop for
    _first_at: float = 0.0
    _previous: dict[int, Any] = attrs.Factory(dict)

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received, self._first_at = signum, time.monotonic()
            if self.note:
                # os.write, not print: a handler may run in the middle of another print
                os.write(2, f"{STOPPING} ({signal.Signals(signum).name}; Ctrl-C again to stop at once)\n".encode())
            return
        self._restore()
        if time.monotonic() - self._first_at >= SAME_REQUEST_S:
            raise StopNow(signum)

    def agreed(self, launch: Launch) -> bool:
        """Whether every process stops after this iteration (collective: each calls it once per
        iteration); records the signal in ``stopped_by`` (SIGTERM over SIGINT when both came)."""
        self.stopped_by = launch.largest(self.received or 0) or None
        return self.stopped_by is not None

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 128 + its number (130, 143)."""
        assert self.stopped_by is not None
        return 128 + self.stopped_by


STOPPING = "stopping after the iteration in progress, with its checkpoint and report"


#: set by ``fgrpo launch`` for the processes it starts: its own options, for the resume command
LAUNCH_OPTIONS = "FGRPO_LAUNCH_OPTIONS"


def resume_line(recipe: str, out: str | None, overrides: Sequence[str], run: Any) -> str:
    """What a signal left (the checkpoint of the last iteration, the report) and the command that
    goes on from it: the same recipe, overrides and run folder, with --resume."""
    from fgrpo.core import checkpoint as ckpt

    assert run.io.out_dir is not None and run.saved_at is not None  # the trainer checkpointed its stop
    checkpoint = run.io.out_dir / "checkpoints" / ckpt.folder_name(run.saved_at)
    command = ["fgrpo", "compose", recipe, "--out", out or str(run.io.out_dir)]
    command += [word for o in overrides for word in ("--set", o)] + ["--resume"]
    launch = os.environ.get(LAUNCH_OPTIONS)
    if launch is not None:
        command[1:1] = ["launch", *shlex.split(launch)]
    report = f"; report {run.io.report}" if run.io.report is not None else ""
    return (
        f"interrupted after iteration {run.saved_at}: checkpoint {checkpoint}{report}; "
        f"go on with: {shlex.join(command)}"
    )
