"""Co-located workers share the host's cores step by step, not half each for good.

The stack starts its prefill and decode workers on one host. Split for good (each on
`--torch-threads`, the cores over the workers), a worker with nothing to step leaves its
share idle while the other steps on its own: decode alone between prompts, prefill alone at
the start of a burst. With a share, each worker marks one byte of a small file the stack
made (`CoreShareSpec`) while it has a step to run, and runs each step on the cores divided by
the workers stepping now: all of them alone, its share beside the others. The engine thread
alone reads and writes its byte and sets its intra-op threads, only when the count changes.

Only cores nothing else wants are taken: where other work keeps the host's cores busy (the
kernel's count of tasks runnable now, /proc/loadavg), a worker stays on its share. An OpenMP
team there waits at every barrier for a member the scheduler has not run yet: at load 20-40
on 2 cores, prefill steps on two threads took so long that paired rooms waited past decode's
30 s pairing limit (3 of 16 requests a 504), where one thread a worker kept them all.

What it can cost: two workers that both see the other idle for one step run that step on
all the cores each (a step's worth of oversubscription, no wrong answer), and a worker that
dies while marked keeps the others at their share (the fixed split, as without a share).
Nothing here touches a request, a page or the ledger; it decides thread counts only.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "KVFENCE_CORE_SHARE"  # set by the stack for its own workers only (`Stack._spawn`)


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
        runnable: Callable[[], int | None] = lambda: runnable_tasks(),
    ) -> None:
        self.spec = spec
        self._set_threads = set_threads
        self._runnable = runnable
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
        runnable = self._runnable()
        if threads > 1 and runnable is not None:
            # Every task runnable now but this thread holds a core: take only what is left.
            threads = max(1, min(threads, self.spec.cores - (runnable - 1)))
        if threads != self._threads:
            self._set_threads(threads)
            self._threads = threads

    @property
    def threads(self) -> int:
        return self._threads

    def close(self) -> None:
        self._map[self.spec.slot] = 0
        self._map.close()


def runnable_tasks() -> int | None:
    """Tasks runnable on this host now, this thread included (/proc/loadavg's "R/T" field);
    None where the kernel does not say."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


def from_environment(set_threads: Callable[[int], None]) -> CoreShare | None:
    spec = CoreShareSpec.from_env(os.environ)
    return None if spec is None else CoreShare(spec, set_threads)
