"""Per-tenant admission limits: counting, 429 + Retry-After, and the tenants file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfence.serve.errors import ApiError
from kvfence.serve.limits import AdmissionLimits, TenantLimits
from kvfence.serve.tenants import TenantFileError, TenantRegistry

KEY = "sk-kvf-0123456789abcdef"


def test_concurrency_and_queued_tokens_are_limited_and_given_back_once() -> None:
    limits = AdmissionLimits({"a": TenantLimits(max_concurrent=2, max_queued_tokens=100)})
    first = limits.acquire("a", 80)
    with pytest.raises(ApiError) as e:
        limits.acquire("a", 30)  # 80 + 30 > 100 tokens waiting
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    assert "100" in e.value.message and e.value.code == "tenant_over_limit"
    first.prefilled()
    second = limits.acquire("a", 30)  # the first prompt no longer waits
    with pytest.raises(ApiError, match="2 requests in flight, the limit is 2"):
        limits.precheck("a")
    for slot in (first, first, second, second):  # released twice: counted once
        slot.release()
    assert limits.report("a") | {"limits": None} == {
        "tenant": "a", "limits": None, "in_flight": 0, "queued_tokens": 0, "refused": 2,
    }  # fmt: skip
    # A prompt over the token limit alone is admitted when nothing else waits.
    limits.acquire("a", 500).release()
    # Tenants without limits are unlimited.
    assert [limits.acquire("b", 10**6) for _ in range(50)]


def test_tenants_file_carries_limits_and_refuses_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    entry = {"name": "a", "keys": [KEY], "limits": {"max_concurrent": 3, "max_queued_tokens": 9}}
    path.write_text(json.dumps({"tenants": [entry]}))
    registry = TenantRegistry.from_file(path)
    assert registry.limits()["a"] == TenantLimits(3, 9)
    assert json.loads(registry.to_json())["tenants"][0]["limits"]["max_concurrent"] == 3
    for bad in ({"max_concurrent": 0}, {"max_concurrent": "3"}, {"burst": 1}, []):
        path.write_text(json.dumps({"tenants": [{**entry, "limits": bad}]}))
        with pytest.raises(TenantFileError, match=r"tenants\[0\].*limits"):
            TenantRegistry.from_file(path)
