"""SIGTERM to the embedded audit stops the servers it started (none is left orphaned)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHILD = """
import sys, time
from pathlib import Path
from kvfence.audit.embedded import HARDENED, started_all, wait_ready
with started_all((("hardened", HARDENED),), Path(sys.argv[1])) as servers:
    wait_ready(servers[0])
    print("ready", flush=True)
    time.sleep(600)
"""


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_stops_every_embedded_server(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    servers: set[int] = set()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        servers = _descendants(proc.pid)
        assert servers, "the embedded server is not a child of the audit"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM  # unwound, not killed outright
        deadline = time.monotonic() + 20
        while any(map(_alive, servers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sorted(p for p in servers if _alive(p))
        assert not left, f"servers left running after SIGTERM: {left}"
    finally:
        for pid in servers | _descendants(proc.pid) | {proc.pid}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
