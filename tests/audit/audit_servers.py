"""Real `kvfence serve` processes on loopback for the audit's end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvfence.serve.supervisor import free_port
from kvfence.startup_wait import Probe, wait_started

KEY_A = "audit-tenant-a-0123456789"
KEY_B = "audit-tenant-b-0123456789"
KEY_OP = "audit-operator-0123456789"  # /metrics and the full /server_info are operator data
INCIDENT_FAULTS = (
    "undersized-pool",
    "abort-not-terminal",
    "decode-trusts-bootstrap",
    "no-ledger-check",
)
# The lab's scale (kvfence.lab.profiles.Scale): context 512, prefill pool 21 x 16 = 336 tokens.
CONTEXT = 512
SMALL_PREFILL = "prefill=21,decode=64"
LARGE = "prefill=64,decode=64"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


def start(
    tmp: Path,
    name: str,
    *,
    pages: str,
    faults: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
) -> Server:
    tenants = tmp / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [{"name": "alice", "keys": [KEY_A]}, {"name": "bob", "keys": [KEY_B]}],
                "operator_keys": [KEY_OP],
            }
        )
    )
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        "from kvfence.cli import main; main()",
        "serve",
        "--model-kind",
        "mirror",
        "--port",
        str(port),
        "--tenants",
        str(tenants),
        "--context-length",
        str(CONTEXT),
        "--kv-pages",
        pages,
    ]
    for f in faults:
        cmd += ["--lab-fault", f]
    cmd += list(extra)
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return Server(f"http://127.0.0.1:{port}", proc, log)


def wait_ready(server: Server) -> None:
    """Until /health answers 200; the wait follows the server (kvfence.startup_wait)."""

    def healthy() -> Probe:
        try:
            status = httpx.get(server.url + "/health", timeout=2).status_code
        except httpx.HTTPError as err:
            return Probe(False, type(err).__name__)
        return Probe(status == 200, f"HTTP {status}")

    wait_started(f"kvfence serve at {server.url}/health", server.proc, server.log, healthy)


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
