"""`GET /version` on every kvfence HTTP server: the installed package's version, no key needed."""

from __future__ import annotations

from importlib import metadata

import pytest
from metrics_helpers import Stepped
from starlette.testclient import TestClient

from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.edge import Edge, EdgeSpec

EXPECTED = {"version": metadata.version("kvfence"), "engine": "kvfence"}


def test_the_server_answers_version_without_a_key_and_documents_it(stepped: Stepped) -> None:
    # The same app serves one process, the hub's router and each sglang worker (create_app).
    r = stepped.http.get(stepped.url + "/version")
    assert r.status_code == 200, r.text
    assert r.json() == EXPECTED
    assert stepped.http.post(stepped.url + "/version").status_code == 405
    doc = stepped.http.get(stepped.url + "/openapi.json", headers=stepped.headers()).json()
    op = doc["paths"]["/version"]["get"]
    assert op["security"] == []  # no key, as the route answers
    schema = op["responses"]["200"]["content"]["application/json"]["schema"]
    assert set(schema["required"]) == set(EXPECTED)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_the_sglang_stack_edge_answers_version_itself(method: str) -> None:
    # Nothing behind it runs: the answer is the edge's own, not a worker's.
    spec = EdgeSpec(
        router="http://127.0.0.1:9", workers=("http://127.0.0.1:9",), side="http://127.0.0.1:9",
        secret="s" * 32, model="tiny", body_limit=1 << 20, pool_tokens=4096, longest=2048,
    )  # fmt: skip
    edge = Edge(spec, TenantRegistry.generate(("a",)))
    r = TestClient(edge).request(method, "/version")  # no lifespan: the edge serves none
    if method == "GET":
        assert r.status_code == 200 and r.json() == EXPECTED
    else:
        assert r.status_code == 405 and r.headers["allow"] == "GET"
