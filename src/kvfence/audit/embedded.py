"""The embedded default: `kvfence audit` with no `--target`.

Starts kvfence's own server twice on loopback — the lab's Workers AI
incident configuration and the hardened engine with a pool that holds the
context — audits both side by side with the full runbook, and stops them.
The servers are separate `kvfence serve` processes: the audit still reaches
them over HTTP only, exactly as it reaches any other engine (the fault names
below are the public `--lab-fault` command-line switches, not imports).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import httpx

from kvfence.audit.base import DEFAULT_ALPHA, Budget, CheckResult
from kvfence.audit.check_table import EMBEDDED_CHECKS, preload_checks
from kvfence.audit.contract import AuditContext
from kvfence.audit.runbook import AuditRun, run_audit
from kvfence.audit.target_names import TargetSpec
from kvfence.startup_wait import Probe, StartupBounds, wait_started

KEY_A = "embedded-tenant-a-key-0001"
KEY_B = "embedded-tenant-b-key-0002"
KEY_OPERATOR = "embedded-operator-key-0003"
# The lab's scale: context 512; the incident's prefill pool is 21 pages x 16 = 336 tokens
# (0.66 x context, like 681,280 / 1,048,576); the fix holds 64 pages = 2 x context.
COMMON = (
    "--disaggregated",
    "--router",
    "kvfence",  # its own hub: the demo's budget and its checks at kvfence's edge (README)
    # The mirror head (leaks read as text) over a small real Llama body (prefill costs what
    # a transformer's does, so signal 3 is measurable): see kvfence.model.mirror.
    "--model-kind",
    "mirror-body",
    "--preset",
    "demo",
    "--context-length",
    "512",
    "--page-size",
    "16",
)
INCIDENT = (
    "--kv-pages", "prefill=21,decode=64",
    "--lab-fault", "undersized-pool", "--lab-fault", "abort-not-terminal",
    "--lab-fault", "decode-trusts-bootstrap", "--lab-fault", "no-ledger-check",
)  # fmt: skip
HARDENED = ("--kv-pages", "prefill=64,decode=64")
# What the reports call the two servers (as `--target NAME=URL` would name them).
REPORT_NAMES = MappingProxyType(
    {"workers-ai-2026": "incident lab (workers-ai-2026)", "hardened": "hardened"}
)
STARTED_HERE = "started by this command as `kvfence serve`"


# The line `kvfence serve` prints once it listens (launch/cli.py: announce).
ANNOUNCED = re.compile(rb"kvfence serving \S+ at (http://\S+)")


@dataclass(frozen=True, slots=True)
class EmbeddedServer:
    name: str
    url: str


@dataclass(frozen=True, slots=True)
class Starting:
    """A `kvfence serve` started with `--port 0`: it binds a port of the OS's choosing and
    says which once it listens. A port picked free here and handed over was free only until
    the server bound it, and another process could take it first."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def announced(self) -> str | None:
        """The URL the server said it listens at, or None while it has not said."""
        m = ANNOUNCED.search(self.log.read_bytes())
        return m.group(1).decode() if m else None


def _write_tenants(workdir: Path) -> Path:
    tenants = workdir / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {"name": "tenant-a", "keys": [KEY_A]},
                    {"name": "tenant-b", "keys": [KEY_B]},
                ],
                "operator_keys": [KEY_OPERATOR],
            }
        )
    )
    return tenants


@contextmanager
def started_all(specs: Sequence[tuple[str, Sequence[str]]], root: Path) -> Iterator[list[Starting]]:
    """`kvfence serve` processes (name, extra args), started together and stopped together:
    every one is told to stop before any is waited for, so their shutdowns overlap. Each is
    `Starting` until `wait_ready` has its URL and a 200 from /health."""
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[Starting] = []
    with ExitStack() as logs, _terminate_unwinds():
        try:
            for name, args in specs:
                workdir = root / name
                workdir.mkdir()
                cmd = [sys.executable, "-c", "from kvfence.cli import main; main()", "serve"]
                cmd += ["--port", "0", "--tenants", str(_write_tenants(workdir))]
                cmd += [*COMMON, *args]
                log_path = workdir / f"{name}.log"
                log = logs.enter_context(open(log_path, "wb"))
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
                servers.append(Starting(name, procs[-1], log_path))
            yield servers
        finally:
            _stop_all(procs)


@contextmanager
def _terminate_unwinds() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) while the servers run, so `started_all`'s clean-up
    stops them: Python's default for SIGTERM exits at once and left every server running.
    Only the main thread can set a handler; elsewhere the caller's handling stands."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 20.0) -> None:
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(server: Starting, bounds: StartupBounds | None = None) -> EmbeddedServer:
    """The server once it has said where it listens and answers /health with 200. The wait
    follows the server (kvfence.startup_wait): it ends with the log's end as soon as the
    server exits, and when it stalls or outlasts the cap, naming what it waited for."""
    url: str | None = None

    def probe() -> Probe:
        nonlocal url
        url = url or server.announced()
        if url is None:
            return Probe(False, "not yet announced where it listens")
        try:
            status = httpx.get(url + "/health", timeout=2).status_code
        except httpx.HTTPError as err:
            return Probe(False, f"{url}/health: {type(err).__name__}")
        return Probe(status == 200, f"{url}/health: HTTP {status}")

    wait_started(f"embedded server {server.name}", server.proc, server.log, probe, bounds)
    assert url is not None  # the probe said ready, so it had the URL
    return EmbeddedServer(server.name, url)


def audit_embedded(
    checks: Sequence[str] = EMBEDDED_CHECKS,
    headroom: float = 1.25,
    seed: int = 0,
    progress: Callable[[str, float | None], None] | None = None,
    budget: Budget | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    alpha: float = DEFAULT_ALPHA,
) -> AuditRun:
    """Start the incident lab and the hardened engine, audit both, stop them."""
    specs = (("workers-ai-2026", INCIDENT), ("hardened", HARDENED))
    with (
        tempfile.TemporaryDirectory(prefix="kvfence-embedded-") as tmp,
        started_all(specs, Path(tmp)) as starting,
    ):
        preload_checks(checks)  # while the servers import torch and load their models
        servers = []
        for s in starting:
            if progress is not None:
                progress(f"starting {s.name}", None)
            servers.append(wait_ready(s))
        ctx = AuditContext(
            key_a=KEY_A,
            key_b=KEY_B,
            operator_key=KEY_OPERATOR,
            headroom=headroom,
            seed=seed,
            budget=budget or Budget(),
            alpha=alpha,
        )
        if progress is not None:
            ctx.progress = progress
        with ctx.open():
            return run_audit(
                [TargetSpec(REPORT_NAMES[s.name], s.url, STARTED_HERE) for s in servers],
                ctx,
                engine="kvfence",
                checks=checks,
                on_result=on_result,
                separate_targets=True,  # two process trees on loopback with nothing in common
            )
