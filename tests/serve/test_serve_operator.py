"""Operator data (I10): /metrics, live pool usage and lab facts need the operator key."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from serve_helpers import Served, serve

from kvfence.serve.build import PoolSizes
from kvfence.serve.info import tenant_view
from kvfence.serve.tenants import Tenant, TenantFileError, TenantRegistry

POOLS = PoolSizes(prefill_pages=64, decode_pages=64)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_key_gets_403_on_metrics_and_the_operator_key_reads_it(mirror: Served) -> None:
    r = mirror.get("/metrics", "a")
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "operator_only" and "operator key" in r.text
    assert httpx.get(mirror.url + "/metrics").status_code == 401
    ok = mirror.get("/metrics", "operator")
    assert ok.status_code == 200 and "kvfence_prefill_seconds" in ok.text


def test_a_tenant_sees_capacity_facts_and_only_its_own_usage(mirror: Served) -> None:
    full = mirror.get("/server_info", "operator").json()
    assert "lab" in full and "pages_used" in full["pools"][0]
    mirror.router.rooms["room-of-b"] = "b"  # as if b had a request in flight
    try:
        a = mirror.get("/server_info", "a").json()
        b = mirror.get("/server_info", "b").json()
    finally:
        del mirror.router.rooms["room-of-b"]
    assert a["usage"] == {"tenant": "a", "live_requests": 0}
    assert b["usage"] == {"tenant": "b", "live_requests": 1}
    for view in (a, b):
        assert "lab" not in view
        assert all(set(p) == {"role", "pool_tokens", "page_size"} for p in view["pools"])
        # What a deploy gate needs stays readable with a tenant key.
        assert view["max_total_num_tokens"] == full["max_total_num_tokens"]
        assert view["capacity_gate"] == full["capacity_gate"]


def test_the_operator_key_is_not_a_tenant_key(mirror: Served) -> None:
    r = mirror.post("/v1/completions", "operator", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 401


def test_without_operator_keys_nobody_reads_operator_data(checkpoint: Path) -> None:
    tenants = TenantRegistry((Tenant("a", ("tenant-a-key-0123456789",)),))
    with serve(checkpoint, tenants=tenants, pools=POOLS, context_length=256) as s:
        assert (
            s.http.get(s.url + "/metrics", headers=bearer("tenant-a-key-0123456789")).status_code
            == 403
        )
        info = s.http.get(s.url + "/server_info", headers=bearer("tenant-a-key-0123456789")).json()
        assert "lab" not in info and info["usage"]["tenant"] == "a"


def test_dev_mode_is_the_operator(checkpoint: Path) -> None:
    with serve(checkpoint, tenants=TenantRegistry.dev(), pools=POOLS, context_length=256) as s:
        assert s.http.get(s.url + "/metrics").status_code == 200
        assert "lab" in s.http.get(s.url + "/server_info").json()


def test_tenants_file_operator_keys(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps(
            {
                "tenants": [{"name": "a", "keys": ["tenant-a-key-0123456789"]}],
                "operator_keys": ["operator-key-0123456789"],
            }
        )
    )
    reg = TenantRegistry.from_file(path)
    assert reg.operator_keys == ("operator-key-0123456789",)
    assert reg.is_operator("Bearer operator-key-0123456789")
    assert not reg.is_operator("Bearer tenant-a-key-0123456789") and not reg.is_operator(None)
    assert reg.authenticate("Bearer operator-key-0123456789") is None
    assert TenantRegistry.from_file(_write(tmp_path, reg.to_json())) == reg
    clash = {"tenants": [{"name": "a", "keys": ["same-key-0123456789"]}]}
    with pytest.raises(TenantFileError, match="also used"):
        TenantRegistry.from_file(
            _write(tmp_path, json.dumps({**clash, "operator_keys": ["same-key-0123456789"]}))
        )
    with pytest.raises(TenantFileError, match="operator_keys must be a list"):
        TenantRegistry.from_file(_write(tmp_path, json.dumps({**clash, "operator_keys": "k"})))
    with pytest.raises(ValueError, match="printable ASCII"):
        reg.with_operator_keys(("short",))


def test_tenant_view_drops_live_fields_only() -> None:
    full = {
        "model": "m",
        "lab": {"faults": ["x"]},
        "pools": [{"role": "prefill", "pool_tokens": 1, "page_size": 16, "pages_used": 3,
                   "pages_free": 1, "pages_pending": 0}],
    }  # fmt: skip
    view = tenant_view(full, "a", 2)
    assert view["pools"] == [{"role": "prefill", "pool_tokens": 1, "page_size": 16}]
    assert view["model"] == "m" and "lab" not in view and view["usage"]["live_requests"] == 2


def _write(tmp: Path, text: str) -> Path:
    p = tmp / f"f{abs(hash(text))}.json"
    p.write_text(text)
    return p
