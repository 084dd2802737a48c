"""A real kvfence server on loopback for the hardening tests, and the checks they share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, ServerParts, build_local
from kvfence.serve.http_edge import DEFAULT_HTTP_LIMITS, HttpLimits
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

# 4xx bodies with no single field at fault: the whole body, the credential, the route.
# Whole-request errors: no field is at fault (a credential, the body as a whole, the route).
FIELDLESS_CODES = frozenset(
    {
        "invalid_json",
        "invalid_utf8",
        "body_too_large",
        "invalid_api_key",
        "operator_only",
        "not_found",
        None,
    }
)


@dataclass
class Live:
    url: str
    parts: ServerParts
    tenants: TenantRegistry

    def key(self, tenant: str | None = None) -> str:
        """The key of `tenant` (default: the first in the registry)."""
        name = tenant or self.tenants.tenants[0].name
        return next(t.keys[0] for t in self.tenants.tenants if t.name == name)

    def auth(self, tenant: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key(tenant)}"}

    def operator_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tenants.operator_keys[0]}"}

    def info(self) -> dict[str, Any]:
        """The operator's /server_info (live pool usage is operator data)."""
        r = httpx.get(self.url + "/server_info", headers=self.operator_auth(), timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def pages_in_use(self) -> dict[str, int]:
        return {p["role"]: p["pages_used"] + p["pages_pending"] for p in self.info()["pools"]}

    def settle(self, deadline_s: float = 60.0) -> dict[str, int]:
        """Quiesce, drop the prefix cache, check the ledger; returns pages still in use."""
        end = time.monotonic() + deadline_s
        while self.pages_in_use()["decode"] and time.monotonic() < end:
            time.sleep(0.05)
        pipeline = self.parts.pipeline
        assert pipeline.wait_idle(timeout=deadline_s)
        pipeline.clear_prefix_cache()
        pipeline.check_integrity()  # raises on any ledger inconsistency
        return self.pages_in_use()


@contextmanager
def live_server(
    checkpoint: Path,
    *,
    tenants: TenantRegistry | None = None,
    kind: str = "mirror",
    context_length: int | None = 256,
    pages: int = 256,
    body_timeout_s: float = 60.0,
    chunk_size: int | None = None,
    http_limits: HttpLimits = DEFAULT_HTTP_LIMITS,
) -> Iterator[Live]:
    parts = build_local(
        LocalSpec(
            checkpoint,
            kind=kind,
            context_length=context_length,
            pools=PoolSizes(prefill_pages=pages, decode_pages=pages),
            chunk_size=chunk_size,
        )
    )
    parts = replace(parts, config=replace(parts.config, body_timeout_s=body_timeout_s))
    registry = tenants or TenantRegistry.generate(("a", "b"))
    if not registry.operator_keys and registry.auth != "none":
        registry = registry.with_operator_keys(("hardening-operator-key-0001",))
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, registry)
    parts.pipeline.start()
    try:
        with ServerThread(app, limits=http_limits) as srv:
            yield Live(srv.url, parts, registry)
    finally:
        parts.pipeline.stop()


def error_problem(status: int, body: object) -> str | None:
    """None when a 4xx body is an OpenAI error that names its field; else what is wrong."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"{status}: not an error envelope: {str(body)[:200]}"
    err = body["error"]
    if not isinstance(err.get("message"), str) or not err["message"]:
        return f"{status}: error without a message: {err}"
    if err.get("code") in FIELDLESS_CODES or status in (401, 404, 405, 413, 429):
        return None
    if not isinstance(err.get("param"), str):  # "" is a field too: `{"": 1}`
        return f"{status}: field error that names no field: {err}"
    return None


@contextmanager
def hub_cli(
    args: Sequence[str], tmpdir: Path, start_s: float
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`kvfence serve --disaggregated --router kvfence ARGS` started; yields what it printed up
    to its `try: curl` line (read for at most `start_s`) and the process; SIGINT on exit."""
    argv = [sys.executable, "-m", "kvfence", "serve", "--disaggregated", "--router", "kvfence",
            *args]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines: list[str] = []
    end = time.monotonic() + start_s
    while time.monotonic() < end and not (lines and lines[-1].startswith("try: curl")):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    try:
        yield "".join(lines), proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
