"""Co-located workers share the host's cores step by step, not half each for good.

The stack starts its prefill and decode workers on one host. Split for good (each on
`--torch-threads`, the cores over the workers), a worker with nothing to step leaves its
share idle while the other steps on its own: decode alone between prompts, prefill alone at
the start of a burst. With a share, each worker marks one byte of a small file the stack
made (`CoreShareSpec`) while it has a step to run, and runs each step on the cores divided by
the workers stepping now: all of them alone, its share beside the others. The engine thread
alone reads and writes its byte and sets its intra-op threads, only when the count changes.

Only cores nothing else wants are taken. Over the last fifth of a second or more, a worker
counts the cores it could have had: the host's idle time (/proc/stat) plus its own process's
CPU time, each divided by the wall time. A second thread is taken only when a whole core's
worth (less a margin) was free. An OpenMP team on a core someone else holds waits at every
barrier for a member the scheduler has not run yet: with two busy processes on 2 cores, two
threads a worker served 7.6 tokens/s where one thread served 31. Counting the worker's own
use keeps a two-thread step from reading its own work as a busy host. The count of tasks
runnable at one instant (/proc/loadavg) does not work here: the router, the edge and the
client that carry each token are runnable beside a stepping worker on a host with free cores.

What it can cost: two workers that both see the other idle for one step run that step on
all the cores each (a step's worth of oversubscription, no wrong answer), and a worker that
dies while marked keeps the others at their share (the fixed split, as without a share).
Nothing here touches a request, a page or the ledger; it decides thread counts only.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "KVFENCE_CORE_SHARE"  # set by the stack for its own workers only (`Stack._spawn`)
# A core counts as free when at least this much of it was: a team member that gets less
# than most of a core holds every barrier of the step.
FREE_CORE = 0.7


@dataclass(frozen=True, slots=True)
class CoreShareSpec:
    """Where the stack's scoreboard is, which byte is this worker's, and the host's cores."""

    path: str
    slot: int
    slots: int
    cores: int

    def __post_init__(self) -> None:
        if not 0 <= self.slot < self.slots:
            raise ValueError(f"core share: slot {self.slot} outside 0..{self.slots - 1}")
        if self.cores < 1:
            raise ValueError(f"core share: {self.cores} cores")

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> CoreShareSpec | None:
        raw = environ.get(ENV)
        if not raw:
            return None
        try:
            return cls(**json.loads(raw))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{ENV} is not a core share ({e}): {raw!r}") from None

    @staticmethod
    def create(path: Path, slots: int) -> None:
        """The stack's scoreboard: one zero byte a worker (nobody stepping)."""
        path.write_bytes(bytes(slots))


class CoreShare:
    """One worker's view of the scoreboard; used from its engine thread only."""

    def __init__(
        self,
        spec: CoreShareSpec,
        set_threads: Callable[[int], None],
        free: Callable[[], float | None] | None = None,
    ) -> None:
        self.spec = spec
        self._set_threads = set_threads
        self._free = free if free is not None else FreeCores(spec.cores)
        self._threads = 0  # what was last set (0: nothing yet)
        with open(spec.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), spec.slots)

    def stepping(self, busy: bool) -> None:
        """Before a turn of the loop: mark this worker busy or idle; when busy, take its
        threads for the step from the workers stepping now."""
        self._map[self.spec.slot] = 1 if busy else 0
        if not busy:
            return
        active = sum(1 for b in self._map[: self.spec.slots] if b)
        threads = max(1, self.spec.cores // max(1, active))
        free = self._free()
        if threads > 1 and free is not None:
            threads = max(1, min(threads, int(free + 1 - FREE_CORE)))
        if threads != self._threads:
            self._set_threads(threads)
            self._threads = threads

    @property
    def threads(self) -> int:
        return self._threads

    def close(self) -> None:
        self._map[self.spec.slot] = 0
        self._map.close()


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """The host's idle and total CPU time (/proc/stat, every core, in ticks), this process's
    CPU seconds and the monotonic clock, read together."""

    idle: int
    total: int
    own_s: float
    at_s: float


def cpu_times() -> CpuTimes | None:
    """Now; None where the kernel does not say (no /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return CpuTimes(idle, sum(fields[:8]), time.process_time(), time.monotonic())


class FreeCores:
    """The cores this process could have used over the last window: the host's idle cores
    plus the ones it used itself. Read again only once `window_s` has passed (ticks are
    10 ms: a shorter window is mostly rounding); in between the last figure stands."""

    def __init__(
        self,
        cores: int,
        window_s: float = 0.2,
        read: Callable[[], CpuTimes | None] = cpu_times,
    ) -> None:
        self._cores = cores
        self._window_s = window_s
        self._read = read
        self._last = read()
        self._free: float | None = None

    def __call__(self) -> float | None:
        now = self._read()
        if now is None or self._last is None:
            return None
        wall = now.at_s - self._last.at_s
        if wall < self._window_s or now.total <= self._last.total:
            return self._free
        idle = self._cores * (now.idle - self._last.idle) / (now.total - self._last.total)
        self._free = idle + (now.own_s - self._last.own_s) / wall
        self._last = now
        return self._free


def from_environment(set_threads: Callable[[int], None]) -> CoreShare | None:
    spec = CoreShareSpec.from_env(os.environ)
    return None if spec is None else CoreShare(spec, set_threads)
