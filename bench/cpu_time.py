"""CPU seconds a process tree spends, read from /proc (Linux).

On a shared host a server's wall time says as much about the scheduler as about its work:
a server whose threads busy-wait takes more of the cores under load and finishes sooner.
The CPU time of its whole process tree (user + system, every thread, every descendant)
is the work it did, whatever share of the cores it got.

How the tree is counted, and where a process that leaves it goes:
- Members are the roots and every process whose parent is a member when `read()` looks.
  Membership sticks: a process stays a member after it is orphaned (reparented outside
  the tree), keyed by pid and start time so a reused pid is not mistaken for it.
- A live member contributes its own time (utime + stime: the kernel folds exited threads
  into it) plus the time of the children it has reaped (cutime + cstime).
- A member that is gone whose nearest live ancestor, by the parents last seen, is a live
  member was reaped inside the tree: its final time is already in that ancestor's cutime
  (this assumes the parent waits for its children, as Python's subprocess and
  multiprocessing do; a parent that ignores SIGCHLD would lose it).
- A member that is gone and was reaped outside the tree (an orphan, or a root) keeps the
  total it had at the last read; what it spent after that read is lost and counted in
  `Reading.departed`, so a bench can say so. Poll often (`Sampling`) to keep that small.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """One process as /proc/PID/stat shows it (times in clock ticks)."""

    pid: int
    ppid: int
    start: int  # start time since boot: tells a reused pid apart
    own: int  # utime + stime, every thread of the process
    reaped: int  # cutime + cstime, the children it has waited for

    @property
    def total(self) -> int:
        return self.own + self.reaped


def parse_stat(pid: int, raw: bytes) -> ProcStat:
    # The command name (field 2) may hold spaces and parentheses: split after its end.
    f = raw[raw.rfind(b")") + 2 :].split()
    return ProcStat(pid, int(f[1]), int(f[19]), int(f[11]) + int(f[12]), int(f[13]) + int(f[14]))


def read_stats() -> dict[int, ProcStat]:
    """Every process on the host now (one that exits while we look is skipped)."""
    stats: dict[int, ProcStat] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stats[int(name)] = parse_stat(int(name), f.read())
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
    return stats


@dataclass(frozen=True, slots=True)
class Reading:
    """The tree's CPU seconds since the meter started, at monotonic time `at`."""

    at: float
    cpu_s: float
    members: int  # live processes counted now
    departed: int  # members that left the tree, reaped outside it, so far


@dataclass(slots=True)
class TreeMeter:
    """Cumulative CPU time of the process trees under `roots` (see the module's notes)."""

    roots: tuple[int, ...]
    _live: dict[tuple[int, int], ProcStat] = field(default_factory=dict)
    _carried: int = 0  # ticks of members reaped outside the tree, at their last read
    _departed: int = 0
    _base: int | None = None  # the ticks at the first read: readings count from it
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self) -> Reading:
        # One read at a time, scan included: a scan older than the state it updates could
        # bring back a member already settled as gone and count it twice.
        with self._lock:
            t0 = time.perf_counter()
            stats = read_stats()
            at = (t0 + time.perf_counter()) / 2  # a scan takes a few ms on a busy host
            now = self._members(stats)
            self._settle_gone(now, stats)
            self._live = now
            ticks = self._carried + sum(s.total for s in now.values())
            if self._base is None:
                self._base = ticks
            return Reading(at, (ticks - self._base) * TICK_S, len(now), self._departed)

    def _members(self, stats: dict[int, ProcStat]) -> dict[tuple[int, int], ProcStat]:
        """Known members still alive, the roots, and every live descendant of those."""
        known = {(s.pid, s.start) for s in self._live.values()}
        alive = [s for s in stats.values() if (s.pid, s.start) in known]
        if self._base is None:  # the first read: the roots (later, a gone root's pid may be reused)
            alive = [stats[r] for r in self.roots if r in stats]
        children: dict[int, list[ProcStat]] = {}
        for s in stats.values():
            children.setdefault(s.ppid, []).append(s)
        found = {(s.pid, s.start): s for s in alive}
        todo = list(alive)
        while todo:
            for kid in children.get(todo.pop().pid, []):
                if (kid.pid, kid.start) not in found:
                    found[(kid.pid, kid.start)] = kid
                    todo.append(kid)
        return found

    def _settle_gone(
        self, now: dict[tuple[int, int], ProcStat], stats: dict[int, ProcStat]
    ) -> None:
        """Carry the last total of each member gone since the last read, unless a live
        member reaped it (then its time is in that member's cutime already)."""
        by_pid = {s.pid: s for s in self._live.values()}
        for key, last in self._live.items():
            if key in now:
                continue
            if not self._reaped_inside(last, by_pid, now):
                self._carried += last.total
                self._departed += 1

    @staticmethod
    def _reaped_inside(
        last: ProcStat, by_pid: dict[int, ProcStat], now: dict[tuple[int, int], ProcStat]
    ) -> bool:
        parent = by_pid.get(last.ppid)
        while parent is not None:
            if (parent.pid, parent.start) in now:
                return True
            parent = by_pid.get(parent.ppid)  # gone too: its own parent reaped both
        return False


def children_of(pid: int) -> tuple[int, ...]:
    """The live processes whose parent is `pid` now."""
    return tuple(sorted(s.pid for s in read_stats().values() if s.ppid == pid))


@dataclass(slots=True)
class Sampling:
    """Reads `meter` every `interval_s` on a thread, so a moment between two reads (a
    first token) can be placed by interpolation, and members that leave are seen first."""

    meter: TreeMeter
    interval_s: float = 0.25
    readings: list[Reading] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Sampling:
        self.read()
        self._thread = threading.Thread(target=self._run, name="cpu-sampling", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.read()

    def read(self) -> Reading:
        r = self.meter.read()
        self.readings.append(r)  # two threads append: `interpolate` sorts by time
        return r

    def cpu_at(self, at: float) -> float:
        return interpolate(self.readings, at)


def interpolate(readings: Iterable[Reading], at: float) -> float:
    """CPU seconds at monotonic time `at`, linear between the readings either side of it.
    Raises ValueError outside the readings' span: a figure there would be a guess."""
    rs = sorted(readings, key=lambda r: r.at)
    times = [r.at for r in rs]
    if not rs or at < times[0] or at > times[-1]:
        span = f"{times[0]:.3f}..{times[-1]:.3f}" if rs else "no readings"
        raise ValueError(f"time {at:.3f} is outside the readings ({span})")
    i = bisect.bisect_left(times, at)
    if times[i] == at:
        return rs[i].cpu_s
    a, b = rs[i - 1], rs[i]
    return a.cpu_s + (b.cpu_s - a.cpu_s) * (at - a.at) / (b.at - a.at)
