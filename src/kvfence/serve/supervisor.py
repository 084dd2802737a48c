"""Run several roles as child processes and stop them all together.

`kvfence serve --disaggregated` starts router, prefill and decode workers as
children. If any child exits, or the parent gets Ctrl-C / SIGTERM, every
other child is stopped too (SIGTERM, then SIGKILL after a grace period), and
the parent says which child ended and how. No orphan keeps a port or a
shared-memory segment, not even when the parent is SIGKILLed and runs no clean-up of its
own: every child is started by `spawn`, which asks the kernel to send it SIGTERM when its
parent dies (Linux `PR_SET_PDEATHSIG`; SIGTERM so a worker still closes its sockets and
unlinks its segments).
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# Linux's default ip_local_port_range, where outgoing connections and binds to port 0 draw.
EPHEMERAL_DEFAULT = (32768, 60999)
# Ports picked by `free_port` lie in [LOW_PORT, the ephemeral range's start), when that is
# at least 4,096 ports (services conventionally sit lower: 8000, 9090, 5432 ...).
LOW_PORT = 20000


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's ephemeral port range, or Linux's default where it cannot be read."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    return lo, hi


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port that is free now, for a program that must be told its port number (SGLang's
    router, Prometheus). Where a program takes port 0 and says what it bound, as `kvfence
    serve` does, start it that way instead: a port is free only until someone binds it.

    The pick is random below the kernel's ephemeral range, so that in the window before
    the program binds it, no outgoing connection's source port and no other bind to port 0
    can land on it, as they can on a port the OS handed out from that range (the range
    busy tests and servers draw from all the time). Where there is no room below the range,
    the OS picks (bind to port 0)."""
    lo, _ = ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(tries if lo - LOW_PORT >= 4096 else 0):
        port = rng.randrange(LOW_PORT, lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use (or lingering): draw another
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parent_death_hook(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that arms `sig` for the child when this process dies; None off Linux.

    The kernel sends the signal when the *thread* that forked the child ends, not only the
    process: start children from the thread that also stops them (the supervisor's own, as
    `Supervisor.run_until_done` and `with Stack(...)` do). The parent may die between the
    fork and the prctl, when no signal would ever come: the child then checks that its
    parent is still the process that forked it, and exits if not."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork, not in the child
    parent = os.getpid()

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # orphaned already: reparented before the prctl
            os._exit(1)

    return arm


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdin: int | None = None,
    stdout: IO[bytes] | int | None = None,
    stderr: IO[bytes] | int | None = None,
) -> subprocess.Popen[bytes]:
    """Start a child that ends when this process ends, however it ends (SIGKILL included)."""
    return subprocess.Popen(
        list(argv),
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        preexec_fn=parent_death_hook(),
    )


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class Supervisor:
    children: Sequence[ChildSpec]
    grace_s: float = 5.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self) -> None:
        for spec in self.children:
            env = {**os.environ, **dict(spec.env)}
            self.procs[spec.name] = spawn(spec.argv, env=env)

    def first_exit(self, poll_s: float = 0.2) -> tuple[str, int]:
        """Block until some child exits; return its name and exit code."""
        while True:
            for name, proc in self.procs.items():
                rc = proc.poll()
                if rc is not None:
                    return name, rc
            time.sleep(poll_s)

    def stop(self) -> None:
        alive = [p for p in self.procs.values() if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in alive:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def run_until_done(self) -> int:
        """Start, wait for the first exit or a signal, stop the rest. Returns the exit code to use."""
        with interrupts_unwind():
            return self._run()

    def _run(self) -> int:
        try:
            self.start()
            name, rc = self.first_exit()
            print(
                f"kvfence: {name} exited with code {rc}; stopping the other roles", file=sys.stderr
            )
            return rc if rc != 0 else 1
        except KeyboardInterrupt:
            print("kvfence: interrupted; stopping every role", file=sys.stderr)
            return 0
        finally:
            self.stop()


def raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT handler: unwind like Ctrl-C, so every `finally` stops its children."""
    raise KeyboardInterrupt


@contextmanager
def interrupts_unwind() -> Iterator[None]:
    """SIGTERM and SIGINT both raise KeyboardInterrupt while the block runs.

    SIGINT is set explicitly, as uvicorn does for the single-process server: a process
    started as a shell's background job inherits SIGINT ignored (POSIX), and Python then
    never installs its Ctrl-C handler, so an operator's `kill -INT` would leave every
    role running."""
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, raise_interrupt) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
