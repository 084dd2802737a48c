"""Real kvfence servers on loopback for the per-switch tests, shared across tests.

Two kinds:
- `ScaledLab`: the lab's own `lab_server` (the incident's scaled geometry:
  context 512, prefill pool 336 tokens) under a given fault set, with tenant
  A's sentinel traffic and tenant B's over-pool prompt run once and kept as an
  `Episode` (what B received, and how the server's metrics moved).
- `Served`: a roomy server (pools far above the gate) with the prefix cache on,
  for switches whose symptom needs neither the undersized pool nor the incident
  traffic (abort-as-success, shared-prefix-cache, no-invalidate).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfence.faults import FaultSet
from kvfence.lab.profiles import Scale
from kvfence.lab.scenario import OPERATOR, LabServer, find_leak, lab_server
from kvfence.lab.scenario import Exchange as LabExchange
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, build_local
from kvfence.serve.pipeline import LocalPipeline
from kvfence.serve.router import Router
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

SCALE = Scale()
SENTINEL = "ZQXHWKRDPM"  # tenant A's secret; fixed so a failure message shows what leaked
A_TOKENS = int(SCALE.prefill_pool_tokens * 0.8)  # fits the prefill pool
B_TOKENS = (SCALE.prefill_pool_tokens + SCALE.context_length) // 2  # > pool, < context
B_MAX_TOKENS = SCALE.page_size * 4


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample, keyed `name{label=value,...}` (labels sorted)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def prompt_of(tokenizer: Tokenizer, unit: str, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` ids made of `unit` repeated (sent as ids: token-exact)."""
    unit_ids = tokenizer.encode(unit)
    return (unit_ids * (n_tokens // len(unit_ids) + 1))[:n_tokens]


@dataclass(frozen=True, slots=True)
class Episode:
    """One run of the incident traffic against one scaled server, as a client saw it."""

    faults: FaultSet
    info: dict[str, Any]
    a_statuses: tuple[int, ...]
    b_status: int
    b_body: dict[str, Any]
    b_text: str  # completion text, or the error message
    b_prompt_tokens: int
    leaked: str | None  # A's sentinel (or a fragment of it) found in B's body
    before: dict[str, float]  # metrics just before B's request
    after: dict[str, float]  # and just after

    def delta(self, metric: str) -> float:
        return self.after.get(metric, 0.0) - self.before.get(metric, 0.0)

    @property
    def error(self) -> dict[str, Any]:
        err = self.b_body.get("error")
        assert isinstance(err, dict), (self.b_status, self.b_body)
        return err


def run_episode(srv: LabServer, faults: FaultSet) -> Episode:
    headers = {t: {"Authorization": f"Bearer {k}"} for t, k in srv.keys.items()}
    a_prompt = prompt_of(srv.tokenizer, f"{SENTINEL} invoice ", A_TOKENS)
    b_prompt = prompt_of(srv.tokenizer, "weather report ", B_TOKENS)

    def complete(client: httpx.Client, tenant: str, prompt: list[int], n: int) -> httpx.Response:
        body = {"model": srv.model, "prompt": prompt, "max_tokens": n, "temperature": 0}
        return client.post(
            "/v1/completions", headers=headers[tenant], json={**body, "ignore_eos": True}
        )

    with httpx.Client(base_url=srv.url, timeout=60) as client:
        a = tuple(complete(client, "tenant-a", a_prompt, 8).status_code for _ in range(2))
        before = parse_metrics(client.get("/metrics", headers=headers[OPERATOR]).text)
        r = complete(client, "tenant-b", b_prompt, B_MAX_TOKENS)
        after = parse_metrics(client.get("/metrics", headers=headers[OPERATOR]).text)
    body = r.json()
    if r.status_code == 200:
        text = "".join(c.get("text", "") for c in body.get("choices", []))
    else:
        text = str(body.get("error", {}).get("message", ""))
    exchange = LabExchange("tenant-b", len(b_prompt), r.status_code, body, text)
    return Episode(
        faults=faults,
        info=srv.info(),
        a_statuses=a,
        b_status=r.status_code,
        b_body=body,
        b_text=text,
        b_prompt_tokens=len(b_prompt),
        leaked=find_leak(exchange, SENTINEL, srv.tokenizer),
        before=before,
        after=after,
    )


@dataclass
class ScaledLab:
    """One episode per fault set, each on its own fresh scaled server (started on first use)."""

    checkpoint: Path
    _episodes: dict[FaultSet, Episode] = field(default_factory=dict)

    def episode(self, faults: FaultSet) -> Episode:
        if faults not in self._episodes:
            with lab_server(self.checkpoint, faults, scale=SCALE) as srv:
                self._episodes[faults] = run_episode(srv, faults)
        return self._episodes[faults]


@dataclass
class Served:
    url: str
    keys: dict[str, str]
    model: str
    pipeline: LocalPipeline
    router: Router  # in-process: only to find a live room, as an operator would
    http: httpx.Client

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def get(self, path: str, tenant: str = "a") -> httpx.Response:
        return self.http.get(self.url + path, headers=self.headers(tenant))

    def post(self, path: str, tenant: str = "a", **kw: Any) -> httpx.Response:
        return self.http.post(self.url + path, headers=self.headers(tenant), **kw)

    def info(self) -> dict[str, Any]:
        r = self.get("/server_info", "operator")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics", "operator").text)

    def quiesce(self) -> None:
        """Wait for the engine to go idle, then empty the prefix cache (a quiescent point)."""
        assert self.pipeline.wait_idle(timeout=60)
        self.pipeline.clear_prefix_cache()


@contextmanager
def roomy_server(checkpoint: Path, faults: FaultSet) -> Iterator[Served]:
    """Pools well above the gate (context 4,096), prefix cache on, tenants a and b."""
    parts = build_local(
        LocalSpec(
            checkpoint,
            kind="mirror",
            pools=PoolSizes(prefill_pages=512, decode_pages=512),
            faults=faults,
        )
    )
    tenants = TenantRegistry.generate(("a", "b"))
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    parts.pipeline.start()
    with ExitStack() as stack:
        stack.callback(parts.pipeline.stop)
        srv = stack.enter_context(ServerThread(app))
        http = stack.enter_context(httpx.Client(timeout=60))
        keys = {t.name: t.keys[0] for t in tenants.tenants}
        keys["operator"] = tenants.operator_keys[0]
        yield Served(srv.url, keys, parts.config.model_name, parts.pipeline, app.state.router, http)
