"""Co-located workers take turns on the host's cores, step by step, each step on all of them.

The stack starts its prefill and decode workers on one host. Split for good (each on
`--torch-threads`, the cores over the workers), both step at once on half the cores: prefill's
prompts go through at one core's pace while decode spends the other on small batches whose
cost is reading the weights, and a worker with nothing to step leaves its half idle. With a
share, the workers take turns instead: a worker holds the cores for one step, runs it on all
of them, and hands them over; a worker that wants a step while another holds them waits for
that step's end. That is the single process's schedule (a prefill chunk, then decode's rows)
across processes: prefill's prompts at the pace of every core, decode's rows in batches that
grew while it waited.

The board is a small file the stack made (`CoreShareSpec`): the cores are an exclusive
`flock` on it, so a worker that dies holding them gives them back with its last descriptor.
Beside the lock, each worker's slot says whether it is in a turn (waiting for the cores or
stepping on them) and which process it is, and the header which slot held the cores last. A worker that held them last and sees another
waiting lets that one go first, so neither role can hold the other off for more than a step.
Nothing waits without end: a holder that has held the cores past `STUCK_S` (a frozen or
starved step) is stepped beside at the split share, as without a share.

Only cores nothing else wants are taken. Over the last fifth of a second or more, a worker
counts the cores the stack could have had: the host's idle time (/proc/stat) plus the CPU
time of the stack's own workers, each divided by the wall time. A second thread is taken only
when a whole core's worth (less a margin) was free. An OpenMP team on a core someone else
holds waits at every barrier for a member the scheduler has not run yet: with two busy
processes on 2 cores, two threads a worker served 7.6 tokens/s where one thread served 31.

What it can cost: a step waits for at most the other's step, and a stuck holder costs its
partner one wait of `STUCK_S`. Nothing here touches a request, a page or the ledger; it
decides when a step runs and on how many threads.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "KVFENCE_CORE_SHARE"  # set by the stack for its own workers only (`Stack._spawn`)
# A core counts as free when at least this much of it was: a team member that gets less
# than most of a core holds every barrier of the step.
FREE_CORE = 0.7
# A holder past this is frozen or starved: its partner steps beside it, at the split share.
STUCK_S = 5.0
# A worker that held the cores last waits this long for a waiting partner to take them.
YIELD_S = 0.05
POLL_S = 0.001  # how often a waiting worker looks again (its cost: well under 1% of a core)
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

# The board: header (the slot holding the cores or -1, the slot that held them last or -1,
# when the holder took them in monotonic ns), then per slot (wants a step 0/1, its pid).
_HEADER = struct.Struct("<iiq")
_SLOT = struct.Struct("<ii")


def _board_size(slots: int) -> int:
    return _HEADER.size + slots * _SLOT.size


@dataclass(frozen=True, slots=True)
class CoreShareSpec:
    """Where the stack's board is, which slot is this worker's, and the host's cores."""

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
        """The stack's board: nobody holds the cores, nobody wants them."""
        path.write_bytes(_HEADER.pack(-1, -1, 0) + bytes(slots * _SLOT.size))


class CoreShare:
    """One worker's view of the board; used from its engine thread only."""

    def __init__(
        self,
        spec: CoreShareSpec,
        set_threads: Callable[[int], None],
        free: Callable[[], float | None] | None = None,
    ) -> None:
        self.spec = spec
        self._set_threads = set_threads
        self._fd = os.open(spec.path, os.O_RDWR | os.O_CLOEXEC)
        self._map = mmap.mmap(self._fd, _board_size(spec.slots))
        self._free = free if free is not None else FreeCores(spec.cores, self.pids)
        self._threads = 0  # what was last set (0: nothing yet)
        self._put(self.spec.slot, wants=False)

    @contextmanager
    def turn(self, busy: bool) -> Iterator[None]:
        """`with share.turn(busy): step`: when busy, the cores for this one step (all of
        them, once the worker holding them has stepped), handed on when it ends. The slot
        wants the cores from the turn's start to its end, and only then."""
        if not busy:
            yield
            return
        self._put(self.spec.slot, wants=True)
        try:
            held = self._acquire()
            self._take(self.spec.cores if held else self._split())
            try:
                yield
            finally:
                if held:
                    self._release()
        finally:
            self._put(self.spec.slot, wants=False)

    @property
    def threads(self) -> int:
        return self._threads

    def pids(self) -> list[int]:
        """The stack's workers that have said who they are."""
        return [pid for _, pid in map(self._slot, range(self.spec.slots)) if pid > 0]

    def close(self) -> None:
        self._map[_slot_at(self.spec.slot) : _slot_at(self.spec.slot) + _SLOT.size] = bytes(
            _SLOT.size
        )
        self._map.close()
        os.close(self._fd)  # a lock still held goes with it

    # ---- the board ---------------------------------------------------------------------

    def _acquire(self) -> bool:
        """Wait for the cores: True once held; False when their holder is stuck. A holder
        the board still names may be gone (its lock went with it): the lock decides."""
        start = time.monotonic()
        while True:
            stuck = self._holder_stuck()
            if stuck or not self._owes_a_turn(start):
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if stuck:
                        return False
                else:
                    _, last, _ = _HEADER.unpack_from(self._map, 0)
                    _HEADER.pack_into(self._map, 0, self.spec.slot, last, time.monotonic_ns())
                    return True
            time.sleep(POLL_S)

    def _release(self) -> None:
        _HEADER.pack_into(self._map, 0, -1, self.spec.slot, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _owes_a_turn(self, since: float) -> bool:
        """This worker stepped last and another is waiting: that one goes first (for a
        moment; a partner that does not come is not waited for)."""
        _, last, _ = _HEADER.unpack_from(self._map, 0)
        if last != self.spec.slot or time.monotonic() - since > YIELD_S:
            return False
        return any(self._slot(i)[0] for i in range(self.spec.slots) if i != self.spec.slot)

    def _holder_stuck(self) -> bool:
        holder, _, since_ns = _HEADER.unpack_from(self._map, 0)
        return holder >= 0 and time.monotonic_ns() - since_ns > STUCK_S * 1e9

    def _split(self) -> int:
        """Beside a stuck holder: the cores over the workers that want them."""
        wanting = sum(1 for i in range(self.spec.slots) if self._slot(i)[0])
        return max(1, self.spec.cores // max(1, wanting))

    def _take(self, threads: int) -> None:
        if threads > 1:
            free = self._free()
            if free is not None:
                threads = max(1, min(threads, int(free + 1 - FREE_CORE)))
        if threads != self._threads:
            self._set_threads(threads)
            self._threads = threads

    def _slot(self, i: int) -> tuple[int, int]:
        wants, pid = _SLOT.unpack_from(self._map, _slot_at(i))
        return wants, pid

    def _put(self, i: int, *, wants: bool) -> None:
        _SLOT.pack_into(self._map, _slot_at(i), int(wants), os.getpid())


def _slot_at(i: int) -> int:
    return _HEADER.size + i * _SLOT.size


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """The host's idle and total CPU time (/proc/stat, every core, in ticks), the CPU
    seconds of the stack's workers and the monotonic clock, read together."""

    idle: int
    total: int
    stack_s: float
    at_s: float


def cpu_times(pids: list[int]) -> CpuTimes | None:
    """Now; None where the kernel does not say (no /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return CpuTimes(idle, sum(fields[:8]), sum(map(_process_s, pids)), time.monotonic())


def _process_s(pid: int) -> float:
    """A process's user + system CPU seconds; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0
    fields = raw[raw.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


class FreeCores:
    """The cores the stack's workers could have used over the last window: the host's idle
    cores plus the ones they used themselves. Read again only once `window_s` has passed
    (ticks are 10 ms: a shorter window is mostly rounding); in between the last figure stands."""

    def __init__(
        self,
        cores: int,
        pids: Callable[[], list[int]],
        window_s: float = 0.2,
        read: Callable[[list[int]], CpuTimes | None] = cpu_times,
    ) -> None:
        self._cores = cores
        self._pids = pids
        self._window_s = window_s
        self._read = read
        self._last = read(pids())
        self._free: float | None = None

    def __call__(self) -> float | None:
        now = self._read(self._pids())
        if now is None or self._last is None:
            return None
        wall = now.at_s - self._last.at_s
        if wall < self._window_s or now.total <= self._last.total:
            return self._free
        idle = self._cores * (now.idle - self._last.idle) / (now.total - self._last.total)
        self._free = idle + max(0.0, now.stack_s - self._last.stack_s) / wall
        self._last = now
        return self._free


def from_environment(set_threads: Callable[[int], None]) -> CoreShare | None:
    spec = CoreShareSpec.from_env(os.environ)
    return None if spec is None else CoreShare(spec, set_threads)
