"""How many CPU threads torch uses, chosen from what this process may use and what others use.

torch's OpenMP threads spin while they wait for work. On a node shared with another CPU-bound
process, a thread that spins on a core the other process needs slows both down: measured on 2
cores beside one busy loop, a tiny SD3 iteration went from 0.27 to 0.89 s with torch's defaults,
0.48 s with passive waiting, 0.45 s with one thread. So, unless the user set them:

- ``OMP_WAIT_POLICY=PASSIVE``, and ``GOMP_SPINCOUNT=10000`` when fgrpo also chooses the count
  (below): a waiting thread spins about 0.1 ms, then sleeps. libgomp (torch's OpenMP on Linux)
  takes an explicit spin count over the policy's; other runtimes read the policy alone. Passive
  waiting alone cost a third on a quiet machine (tiny SD3: 0.288 s per iteration against 0.217 s
  with torch's spinning, which takes 0.712 s beside a busy loop); the short spin keeps both:
  0.214 s quiet, 0.367 s busy (``tools/bench/contention.py``, 2 cores). OpenMP reads these when
  torch's library loads, so :func:`configure` must run before ``import torch``: ``fgrpo`` does.
- ``torch.set_num_threads(n)`` with ``n`` = the CPUs this process may use: its affinity mask
  (``os.sched_getaffinity``: taskset, Slurm, docker --cpuset-cpus) capped by its cgroup's CPU
  quota (docker --cpus, Kubernetes limits), which ``os.cpu_count()`` ignores.
- :class:`ThreadGovernor` re-chooses ``n`` between iterations from the CPU time other processes
  took during the last one (``/proc/stat`` minus this process's own), so a run keeps its threads
  on a quiet node and gives cores back when another job starts.

The float order of a reduction depends on the thread count, so a CPU run whose governor changed
the count (its ``threads`` metric) is not bit-identical to one that kept it: to reproduce a CPU
run bit for bit, fix the count. ``OMP_NUM_THREADS`` set by the user fixes it (no governor, no
spin); ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set by the user is kept; ``FGRPO_THREADS=torch``
leaves everything to torch's defaults (for comparisons: ``tools/bench/contention.py``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

SPIN_COUNT = "10000"  # libgomp spins before a waiting thread sleeps (default 300000, about 3 ms)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup quota allows (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        cfs_quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        cfs_period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return cfs_quota / cfs_period if cfs_quota > 0 and cfs_period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """CPUs this process may run on: the affinity mask, capped by the cgroup quota (at least 1)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        allowed = min(allowed, max(1, math.floor(limit + 0.5)))
    return max(1, allowed)


def configure(environ: dict[str, str] | None = None) -> int | None:
    """Choose torch's threads for this process; returns the count, or None if the user chose.

    Call before ``import torch`` so that the wait policy takes effect; the count is applied at
    once if torch is already imported, else exported as ``OMP_NUM_THREADS`` (which torch reads).
    """
    env = os.environ if environ is None else environ
    if env.get("FGRPO_THREADS") == "torch":
        return None
    users_policy = "OMP_WAIT_POLICY" in env
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "OMP_NUM_THREADS" in env:
        return None
    if not users_policy:
        # Only beside the governor: it keeps the threads within the free cores. A fixed count on
        # a shared core must not spin at all (tiny SD3 beside a busy loop, 2 fixed threads:
        # 0.748 s per iteration with this spin, 0.363 s passive).
        env.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
    n = usable_cpus()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    else:
        env["OMP_NUM_THREADS"] = str(n)
        env["FGRPO_THREADS_CHOSEN"] = "1"  # ours, not the user's: the governor may change it
    return n


def _total_busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy, from the first line of /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields]
    except (OSError, ValueError, IndexError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _set_torch_threads(n: int) -> None:
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class ThreadGovernor:
    """Between iterations, sets torch's thread count to the CPUs not taken by other processes.

    ``others`` = (busy CPU time of the machine - this process's CPU time) / wall time over the
    last interval, in CPUs; threads = round(usable - others), between 1 and ``usable``. Inactive
    (``step`` does nothing) when the user fixed ``OMP_NUM_THREADS`` or /proc/stat is unreadable.
    """

    def __init__(
        self,
        usable: int | None = None,
        environ: dict[str, str] | None = None,
        *,
        busy: Callable[[], float | None] | None = None,
        own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        apply: Callable[[int], None] | None = None,
    ):
        env = os.environ if environ is None else environ
        user_fixed = ("OMP_NUM_THREADS" in env and env.get("FGRPO_THREADS_CHOSEN") != "1") or env.get(
            "FGRPO_THREADS"
        ) == "torch"
        self._busy, self._own, self._clock = busy or _total_busy_seconds, own, clock
        self._apply = apply or _set_torch_threads
        self.usable = usable or usable_cpus()
        self.active = not user_fixed and self.usable > 1 and self._busy() is not None
        self.threads: int | None = None
        self.others = 0.0
        self._last: tuple[float, float, float] | None = None
        self.reset()

    def reset(self) -> None:
        busy = self._busy()
        self._last = (self._clock(), busy, self._own()) if busy is not None else None

    def step(self) -> int | None:
        """Re-choose the thread count from the interval since the last call; returns it."""
        if not self.active or self._last is None:
            return None
        wall0, busy0, own0 = self._last
        self.reset()
        if self._last is None:
            return self.threads
        wall1, busy1, own1 = self._last
        wall = wall1 - wall0
        if wall < 0.05:
            return self.threads
        self.others = max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall)
        threads = int(min(self.usable, max(1, math.floor(self.usable - self.others + 0.5))))
        if threads != self.threads:
            self._apply(threads)
        self.threads = threads
        return threads
