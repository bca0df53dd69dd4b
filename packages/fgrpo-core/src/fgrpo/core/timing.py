"""Where the seconds of an iteration go: model, reward, decode, and the rest (overhead).

A :class:`Clock` accumulates named sections. On a CPU a section is wall time (the work is done
when the call returns). On a GPU the host returns long before the kernels finish, so a section
records a pair of CUDA events instead and nothing waits: :meth:`Clock.read` synchronises once,
at the end of the iteration, and sums the events' elapsed times. A whole phase (the reward, the
decode) is timed with :meth:`Clock.phase`, which synchronises at its two ends: once per phase,
never per model call.

:class:`TimedPolicy` wraps a policy so that every network call (``encode``, ``velocity``) counts
as model time, whichever sampler makes it; samplers need not know about the clock.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: The accounting keys every iteration logs, with time_iteration_s.
SECTIONS = ("model", "reward", "decode")


def synchronize(device: torch.device | str | None) -> None:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Accumulated seconds per section name; one synchronisation per :meth:`read`."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, Any, Any]] = []
        self._lock = threading.Lock()  # a reward worker thread times its phases on the same clock
        self._local = threading.local()  # per thread: sections inside sections count once, by the outermost

    def _add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds

    @contextmanager
    def _outermost(self) -> Iterator[bool]:
        """True for a section that no other section of this thread encloses (the one counted)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield depth == 0
        finally:
            self._local.depth = depth

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the enclosed device work as ``name`` without waiting for it."""
        with self._outermost() as counted:
            if not counted:
                yield
            elif self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    yield
                finally:
                    end.record()
                    with self._lock:
                        self._events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                try:
                    yield
                finally:
                    self._add(name, time.perf_counter() - t0)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time a whole span of work as ``name``, synchronising at both ends (host work included)."""
        with self._outermost() as counted:
            if not counted:
                yield
                return
            synchronize(self.device)
            t0 = time.perf_counter()
            try:
                yield
            finally:
                synchronize(self.device)
                self._add(name, time.perf_counter() - t0)

    def read(self) -> dict[str, float]:
        """Seconds per section since the last read (one synchronisation), then start afresh."""
        with self._lock:
            events, self._events = self._events, []
            if events:
                synchronize(self.device)
                for name, start, end in events:
                    self._seconds[name] += start.elapsed_time(end) / 1000.0
            out = dict(self._seconds)
            self._seconds.clear()
        return out


def accounting(seconds: dict[str, float], wall: float) -> dict[str, float]:
    """``time_<section>_s`` for model, reward and decode, ``time_overhead_s`` (the rest of
    ``wall``) and ``time_iteration_s``. With a reward worker, reward and decode overlap the
    model's sections: their sum may then exceed the wall time and the overhead reads 0."""
    out = {f"time_{name}_s": seconds.get(name, 0.0) for name in SECTIONS}
    out["time_overhead_s"] = max(0.0, wall - sum(out.values()))
    out["time_iteration_s"] = wall
    return out


class TimedPolicy:
    """``policy`` with its network calls counted as ``model`` time on ``clock``; every other
    attribute is the policy's own."""

    def __init__(self, policy: Any, clock: Clock):
        object.__setattr__(self, "_policy", policy)
        object.__setattr__(self, "_clock", clock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._policy, name, value)

    def velocity(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._clock.section("model"):
            return self._policy.velocity(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.section("model"):
            return self._policy.encode(*args, **kwargs)

    @property
    def unwrapped(self) -> Any:
        return self._policy
