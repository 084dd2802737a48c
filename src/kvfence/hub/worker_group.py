"""Every worker of one host from one interpreter: torch imported once, each worker forked.

    python -m kvfence.hub.worker_group SPEC.json [SPEC.json ...]

`kvfence serve --disaggregated` starts its prefill and decode workers with this entry
(hub/launch.py). Importing torch costs each process about 1.3 s of CPU; the main
job's two servers started four workers at once on two cores, so those imports were most
of its start-up. Here the group validates every spec, imports the worker code once,
and forks one worker per spec (named for its spec file: `prefill-0`, `decode-0`). Each
worker then runs exactly what `worker_entry` runs (`run_worker_process`).

Invariants:
- A fork happens only while the group has one thread. Torch's OpenMP pool and zmq's I/O
  threads do not survive a fork; the group never runs a torch op and starts no thread,
  and it checks `/proc/self/task` before it forks. The one thread an import starts is
  numpy's OpenBLAS server (torch imports numpy; kvfence's workers do no numpy linear
  algebra): the group sets `OPENBLAS_NUM_THREADS=1` unless the user set it. If a thread
  is there all the same, the workers start as fresh interpreters (`worker_entry`).
- A worker ends when the group ends, however the group ends: each one arms
  `PR_SET_PDEATHSIG` (supervisor.parent_death_hook), as the group itself did when the
  supervisor spawned it.
- The first worker to exit ends the group: the group says which one and how, stops the
  others (SIGTERM, then SIGKILL after `GRACE_S`, shorter than the supervisor's grace so
  the group reaps its workers before it could be killed itself) and exits with that
  worker's code (1 if it was 0: a worker never ends on its own). SIGTERM or SIGINT to the
  group stops every worker the same way, and the group exits 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfence.serve.specs import EXIT_BAD_SPEC, SpecError, WorkerSpec, read_spec
from kvfence.serve.supervisor import parent_death_hook, spawn

GRACE_S = 4.0  # < Supervisor.grace_s
PR_SET_NAME = 15  # <linux/prctl.h>
EXIT_RAISED = 1  # a forked worker whose role raised: what an uncaught exception exits with


@dataclass(frozen=True, slots=True)
class Member:
    name: str  # the spec file's stem: "prefill-0"
    path: Path
    spec: WorkerSpec


class _Stop(Exception):
    """SIGTERM or SIGINT reached the group."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop


def read_members(argv: Sequence[str]) -> list[Member]:
    """Every spec read and validated before any worker starts (SpecError names the bad one)."""
    if not argv:
        raise SpecError("usage: python -m kvfence.hub.worker_group SPEC.json [SPEC.json ...]")
    return [Member(Path(a).stem, Path(a), read_spec(WorkerSpec, Path(a))) for a in argv]


def threads_now() -> int:
    """This process's threads, as the kernel counts them (1 on a system without /proc)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _namer() -> Callable[[str], None]:
    """Sets the calling process's name (`ps -o comm`, /proc/PID/comm; 15 bytes); a forked
    worker keeps the group's command line, so this is where `ps` tells them apart."""
    if not sys.platform.startswith("linux"):
        return lambda name: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork

    def name_it(name: str) -> None:
        prctl(PR_SET_NAME, ctypes.c_char_p(f"kvf-{name}".encode()[:15]), 0, 0, 0)

    return name_it


# The SIGINT and SIGTERM handlers the group started with: a forked worker gets them back,
# as a worker started by exec would have had them (SIGINT stays ignored in a background job).
Inherited = tuple[signal.Handlers | Callable[..., object] | int | None, ...]


def _fork_worker(member: Member, inherited: Inherited) -> int:
    """Fork one worker; the child never returns from here."""
    arm, name_it = parent_death_hook(), _namer()
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: a worker, as worker_entry would run it
        for sig, handler in zip((signal.SIGINT, signal.SIGTERM), inherited, strict=True):
            signal.signal(sig, handler)
        if arm is not None:
            arm()
        name_it(member.name)
        from kvfence.hub.worker_entry import run_worker_process

        run_worker_process(member.spec)  # ends the process
    except BaseException:  # never unwind into the group's own frames
        print(f"kvfence worker {member.name} failed:", file=sys.stderr)
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(EXIT_RAISED)


def start_members(members: Sequence[Member], alive: dict[int, str], inherited: Inherited) -> None:
    """Start every worker into `alive` (pid -> name) as it starts: forked while the group is
    single-threaded, else as fresh interpreters."""
    if threads_now() == 1:
        for m in members:
            alive[_fork_worker(m, inherited)] = m.name
        return
    print(
        f"kvfence: the worker group has {threads_now()} threads, so it cannot fork safely; "
        "starting each worker as its own interpreter",
        file=sys.stderr,
    )
    argv = (sys.executable, "-m", "kvfence.hub.worker_entry")
    for m in members:
        alive[spawn((*argv, str(m.path))).pid] = m.name


def exit_code(status: int) -> int:
    """A wait status as a process exit code: a signal N reads as 128 + N, like a shell's."""
    rc = os.waitstatus_to_exitcode(status)
    return 128 - rc if rc < 0 else rc


def stop_members(alive: dict[int, str], grace_s: float = GRACE_S) -> None:
    """SIGTERM every live worker, SIGKILL whichever is left after `grace_s`; reap them all."""
    for pid in alive:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        _reap(alive)
        time.sleep(0.02)
    for pid in alive:
        _signal(pid, signal.SIGKILL)
    while alive:
        pid, _ = os.waitpid(-1, 0)
        alive.pop(pid, None)


def _reap(alive: dict[int, str]) -> None:
    while alive:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        alive.pop(pid, None)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited, not reaped yet: nothing to do
        os.kill(pid, sig)


def run_group(members: Sequence[Member]) -> int:
    """Start every worker -> wait for the first exit or a signal -> stop the rest."""
    inherited = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    alive: dict[int, str] = {}
    try:
        start_members(members, alive, inherited)
        pid, status = os.waitpid(-1, 0)
        name, rc = alive.pop(pid, "?"), exit_code(status)
        print(f"kvfence: {name} exited with code {rc}; stopping the other workers", file=sys.stderr)
        return rc if rc != 0 else 1
    except _Stop:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the stop below is not interrupted
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_members(alive)


def main(argv: list[str]) -> int:
    try:
        members = read_members(argv)
    except SpecError as e:
        print(f"kvfence worker group: {e}", file=sys.stderr)
        return EXIT_BAD_SPEC
    from kvfence.serve.startup import collector_paused

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads (docstring)

    with collector_paused():  # the imports every worker shares, done once (serve/startup.py)
        import kvfence.hub.workers  # noqa: F401
    rc = run_group(members)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # like a worker: no finalisation to wait for


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
