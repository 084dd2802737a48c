"""Run several roles as child processes and stop them all together.

`kvfence serve --disaggregated` starts router, prefill and decode workers as
children. If any child exits, or the parent gets Ctrl-C / SIGTERM, every
other child is stopped too (SIGTERM, then SIGKILL after a grace period), and
the parent says which child ended and how. No orphan keeps a port or a
shared-memory segment.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
            self.procs[spec.name] = subprocess.Popen(list(spec.argv), env=env)

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
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
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
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
