"""A real kvfence server on loopback whose engine the test drives step by step.

The pipeline is built but its engine thread is not started: the test calls
`pipeline.pump()` itself, so a request can be held at an exact stage (waiting
for its first token, decoding) while /metrics is read over HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, ServerParts, build_local
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread


@dataclass
class Stepped:
    url: str
    parts: ServerParts
    tenants: TenantRegistry
    http: httpx.Client

    @property
    def model(self) -> str:
        return self.parts.config.model_name

    def headers(self, who: str = "a") -> dict[str, str]:
        if who == "operator":
            return {"Authorization": f"Bearer {self.tenants.operator_keys[0]}"}
        key = next(t.keys[0] for t in self.tenants.tenants if t.name == who)
        return {"Authorization": f"Bearer {key}"}

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample, keyed (name, sorted labels)."""
        r = self.http.get(self.url + "/metrics", headers=self.headers("operator"))
        assert r.status_code == 200, r.text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }


@contextmanager
def stepped_server(checkpoint: Path) -> Iterator[Stepped]:
    pools = PoolSizes(prefill_pages=64, decode_pages=64)
    parts = build_local(LocalSpec(checkpoint, kind="mirror", pools=pools, context_length=512))
    tenants = TenantRegistry.generate(("a", "b"))
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    with ServerThread(app) as srv, httpx.Client(timeout=60) as http:
        yield Stepped(srv.url, parts, tenants, http)
