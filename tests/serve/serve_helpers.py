"""A real kvfence server on loopback (uvicorn in a thread) over the real LocalPipeline."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, ServerParts, build_local
from kvfence.serve.router import Router
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

TENANTS = ("a", "b", "c", "d")
IDLE = {"prefill": 0, "decode": 0}


@dataclass
class Served:
    url: str
    parts: ServerParts
    tenants: TenantRegistry
    router: Router  # in-process; tests use it only to find a live room, as an operator would
    # One client for the helpers: a fresh httpx client per call costs ~0.2 s (TLS context).
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=60))
    _clients: dict[str, openai.OpenAI] = field(default_factory=dict)

    def key(self, tenant: str = "a") -> str:
        """A tenant's key; `"operator"`: the operator key (/metrics, full /server_info)."""
        if tenant == "operator":
            return self.tenants.operator_keys[0]
        return next(t.keys[0] for t in self.tenants.tenants if t.name == tenant)

    def headers(self, tenant: str = "a") -> dict[str, str]:
        if self.tenants.auth == "none":
            return {}
        return {"Authorization": f"Bearer {self.key(tenant)}"}

    def client(self, tenant: str = "a") -> openai.OpenAI:
        """One `openai` client per tenant, reused (thread-safe, like httpx underneath)."""
        if tenant not in self._clients:
            key = "unused" if self.tenants.auth == "none" else self.key(tenant)
            self._clients[tenant] = openai.OpenAI(
                base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120
            )
        return self._clients[tenant]

    @property
    def model(self) -> str:
        return self.parts.config.model_name

    def get(self, path: str, tenant: str = "a") -> httpx.Response:
        return self.http.get(self.url + path, headers=self.headers(tenant))

    def post(self, path: str, tenant: str = "a", **kw: Any) -> httpx.Response:
        return self.http.post(self.url + path, headers=self.headers(tenant), **kw)

    def info(self) -> dict[str, Any]:
        r = self.get("/server_info", "operator")
        assert r.status_code == 200, r.text
        return r.json()

    def pages(self) -> dict[str, int]:
        """Pages in use (used + pending) per role, from /server_info."""
        return {p["role"]: p["pages_used"] + p["pages_pending"] for p in self.info()["pools"]}

    def metrics(self) -> dict[str, float]:
        """Every sample, keyed `name{label=value,...}` (labels sorted)."""
        out: dict[str, float] = {}
        text = self.get("/metrics", "operator").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, deadline_s: float = 60.0) -> dict[str, int]:
        """Wait until no request holds pages, drop the prefix cache, return pages still in use.

        Decode has no prefix cache, so its pool empties as soon as requests end;
        prefill keeps finished prompts' full pages cached (I8), so the cache is
        cleared at the quiescent point before reading. Not a timing assertion:
        the deadline only bounds a hung test.
        """
        end = time.monotonic() + deadline_s
        while self.pages()["decode"] and time.monotonic() < end:
            time.sleep(0.05)
        pipeline = self.parts.pipeline
        assert pipeline.wait_idle(timeout=deadline_s)
        pipeline.clear_prefix_cache()
        pipeline.check_integrity()
        return self.pages()


@contextmanager
def serve(
    checkpoint: Path,
    *,
    kind: str = "mirror",
    tenants: TenantRegistry | None = None,
    request_log: Path | None = None,
    **build: Any,
) -> Iterator[Served]:
    parts = build_local(LocalSpec(checkpoint, kind=kind, **build))
    registry = tenants or TenantRegistry.generate(TENANTS)
    app = create_app(
        parts.pipeline, parts.loaded.tokenizer, parts.config, registry, request_log=request_log
    )
    parts.pipeline.start()
    try:
        with ServerThread(app) as srv, httpx.Client(timeout=60) as http:
            yield Served(srv.url, parts, registry, app.state.router, http)
    finally:
        parts.pipeline.stop()
