"""Waiting for a started server to become ready, for as long as it is visibly getting there.

A fixed deadline is wrong both ways: on a busy machine (load 35 on two cores) a healthy
vLLM needs far longer than any figure measured on a quiet one, and a server that died or
hung is waited for the whole figure. `wait_started` follows the server instead:

- it ends at once, with the end of the server's log, when the process exits;
- it keeps waiting while the server makes progress: its log grows, its readiness probe
  reports a new stage (a URL announced, say), or its process tree spends CPU time (a
  server importing torch at load 35 can print nothing for minutes, yet it is working);
- it gives up when nothing of that has happened for `stall_s` (a hung server: blocked,
  spending no CPU, printing nothing), or after `cap_s` in all (one spinning for ever).

The failure names what was awaited, why the wait ended, the time waited, the load average
and the log's last lines. Stdlib only and no network: the caller's probe does the asking.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Measured here (2 cores): vLLM CPU on the tiny checkpoint was ready in 25 s at load 2.6
# with its log silent for up to 8.6 s, and in 51 s at load 15 with up to 12.5 s of silence;
# its process tree spent CPU time in every second of both. A hung server spends none, so
# the window only has to outlast silence that spends no CPU either: 180 s is over ten
# times the longest silence seen, the room a machine at load 35 needs.
DEFAULT_STALL_S = 180.0
# Only a server that spins without ever becoming ready meets this.
DEFAULT_CAP_S = 1800.0
# CPU time counts as progress once the process tree gained at least this much, and at least
# this share of a core since the last progress: less is clock-tick noise or a timer thread.
_CPU_PROGRESS_S = 0.05
_CPU_SHARE = 0.01
_CPU_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class StartupBounds:
    """How long a start-up may go without progress (`stall_s`) and in all (`cap_s`)."""

    stall_s: float = DEFAULT_STALL_S
    cap_s: float = DEFAULT_CAP_S
    poll_s: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.stall_s <= self.cap_s:
            raise ValueError(
                f"stall_s must be > 0 and <= cap_s, got stall {self.stall_s}, cap {self.cap_s}"
            )
        if self.poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")


@dataclass(frozen=True, slots=True)
class Probe:
    """One readiness check: ready, or not yet at `stage` (any text; a change is progress)."""

    ready: bool
    stage: str = ""


class StartupFailed(RuntimeError):
    """The server exited, stalled or hit the cap before it was ready; the message says which."""

    def __init__(self, what: str, reason: str, elapsed_s: float, log_tail: str) -> None:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        super().__init__(
            f"{what}: {reason} after {elapsed_s:.0f} s waiting (load average {load}).\n"
            f"last log lines:\n{log_tail or '(log empty)'}"
        )
        self.what = what
        self.reason = reason
        self.elapsed_s = elapsed_s


def log_tail(path: Path, lines: int = 30, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of a log file (read from its end only), '' if it is absent."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of `pid` and every live descendant, from /proc; None
    where /proc cannot tell (not Linux, or the process is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        # The command name (field 2) may hold spaces and parentheses: split after its end.
        fields = stat[stat.rfind(b")") + 2 :].split()
        parent[int(name)] = int(fields[1])
        cpu[int(name)] = int(fields[11]) + int(fields[12])
    if pid not in cpu:
        return None
    children: dict[int, list[int]] = {}
    for child, ppid in parent.items():
        children.setdefault(ppid, []).append(child)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0)
        todo += children.get(p, [])
    return total / tick


def wait_started(
    what: str,
    proc: subprocess.Popen[bytes],
    log_path: Path,
    probe: Callable[[], Probe],
    bounds: StartupBounds | None = None,
) -> float:
    """Poll `probe` until it says ready; return the seconds waited. Raise StartupFailed when
    the process exits, makes no progress for `bounds.stall_s`, or `bounds.cap_s` passes.

    `what` names the awaited thing in the failure ("vllm at http://...:8000/v1/models").
    """
    bounds = bounds or StartupBounds()
    start = time.monotonic()
    progress = _Progress(start, _size(log_path), "", tree_cpu_s(proc.pid))
    while True:
        now = time.monotonic()
        if (code := proc.poll()) is not None:
            reason = f"the process exited with {code} before it was ready"
            raise StartupFailed(what, reason, now - start, log_tail(log_path))
        result = probe()
        if result.ready:
            return time.monotonic() - start
        progress.observe(now, _size(log_path), result.stage, proc.pid)
        if now - start >= bounds.cap_s:
            reason = f"not ready within the {bounds.cap_s:.0f} s cap"
            raise StartupFailed(what, reason, now - start, log_tail(log_path))
        if now - progress.at >= bounds.stall_s:
            reason = (
                f"stalled: no new log output, readiness stage or CPU time for "
                f"{bounds.stall_s:.0f} s (last stage: {result.stage or 'none'})"
            )
            raise StartupFailed(what, reason, now - start, log_tail(log_path))
        time.sleep(bounds.poll_s)


class _Progress:
    """When the server last showed progress, and what it showed then."""

    def __init__(self, now: float, size: int, stage: str, cpu: float | None) -> None:
        self.at = now
        self.size, self.stage, self.cpu = size, stage, cpu
        self.cpu_checked = now

    def observe(self, now: float, size: int, stage: str, pid: int) -> None:
        if size > self.size or stage != self.stage:
            self.at, self.size, self.stage = now, size, stage
            return
        # Reading every process's /proc stat costs a few ms: once a second is enough.
        if now - self.cpu_checked < _CPU_EVERY_S:
            return
        self.cpu_checked = now
        cpu = tree_cpu_s(pid)
        if cpu is None:
            return
        # A hung server may still tick (a timer thread); working means a share of a core.
        if self.cpu is None or cpu - self.cpu >= max(_CPU_PROGRESS_S, _CPU_SHARE * (now - self.at)):
            self.at, self.cpu = now, cpu


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
