"""Per-tenant admission limits: counting, 429 + Retry-After, defaults, refusals, the tenants file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfence.serve.errors import ApiError
from kvfence.serve.limits import AdmissionLimits, TenantLimits, default_limits
from kvfence.serve.tenants import Tenant, TenantFileError, TenantRegistry
from kvfence.sglang_stack.router_main import parse
from kvfence.sglang_stack.stack import ROUTER_FAILURE_ARGS

KEY = "sk-kvf-0123456789abcdef"


@dataclass(frozen=True)
class Pools:
    max_total_num_tokens: int
    edge_limit: int


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


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
    # Explicitly unlimited tenants are unlimited.
    open_ = AdmissionLimits({"b": TenantLimits.unlimited()}, default_limits(Pools(64, 64)))
    assert [open_.acquire("b", 10**6) for _ in range(50)]


def test_every_tenant_gets_default_limits_from_the_capacity_unless_lifted() -> None:
    defaults = default_limits(Pools(max_total_num_tokens=65_536, edge_limit=4096))
    assert defaults == TenantLimits(max_concurrent=8, max_queued_tokens=4096, refusal_burst=20)
    assert default_limits(Pools(1 << 20, 4096)) == TenantLimits(
        64, 4096, refusal_burst=20
    )  # a quarter of it
    assert default_limits(Pools(336, 336)) == TenantLimits(8, 336, refusal_burst=20)
    generated = TenantRegistry.generate(("a", "b")).limits()
    configured = {
        **generated,
        "half": TenantLimits(max_concurrent=None),  # one bound lifted, the other default
        "off": TenantLimits.unlimited(),
    }
    limits = AdmissionLimits(configured, defaults)
    for tenant in ("a", "b", "not-listed"):
        assert limits.of(tenant) == defaults, tenant
        slots = [limits.acquire(tenant, 10) for _ in range(8)]
        with pytest.raises(ApiError, match="8 requests in flight, the limit is 8"):
            limits.acquire(tenant, 10)
        for s in slots:
            s.release()
    assert limits.of("half") == TenantLimits(None, 4096, refusal_burst=20)
    assert limits.of("off").is_unlimited
    assert [limits.acquire("off", 10**5) for _ in range(20)]
    # The CLI's explicit choice: every bound left to the default is lifted, set ones stay.
    lifted = TenantRegistry(
        (Tenant("a", (KEY,)), Tenant("b", (KEY[:-1] + "0",), TenantLimits(max_concurrent=3)))
    ).without_default_limits()
    assert lifted.limits() == {
        "a": TenantLimits.unlimited(),
        "b": TenantLimits(3, None, refusal_burst=None),
    }
    assert TenantRegistry.dev().limits()["default"].is_unlimited  # no neighbour to protect


def test_refusals_draw_on_a_bucket_that_answers_429_before_the_body() -> None:
    clock = Clock()
    lim = TenantLimits(refusal_burst=3, refusals_per_s=0.5)
    limits = AdmissionLimits({"a": lim}, default_limits(Pools(4096, 512)), clock)
    over_long = ApiError(400, "prompt too long", code="context_length_exceeded")
    limits.refused("a", ApiError(400, "temperature must be <= 2", code="invalid_value"))
    for _ in range(3):
        limits.precheck("a")  # the body would be read, tokenized, refused
        limits.refused("a", over_long)
    with pytest.raises(ApiError) as e:
        limits.precheck("a")
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "2"}  # 1 token at 0.5/s
    assert "3 refused requests at once or 0.5 per second" in e.value.message
    limits.precheck("b")  # another tenant's bucket is its own
    clock.now += 1.0
    with pytest.raises(ApiError, match="retry after 1 s"):
        limits.precheck("a")
    clock.now += 1.0
    limits.precheck("a")  # refilled: one more refused request may cost work
    # The limits' own 429s (answered unread), field errors (refused while parsing, before
    # the costly part) and unauthenticated requests draw nothing.
    limits.refused("a", ApiError(429, "over", code="tenant_over_limit"))
    limits.refused("a", ApiError(400, "temperature must be <= 2", code="invalid_value"))
    limits.refused(None, over_long)
    limits.precheck("a")
    limits.refused("a", over_long)
    with pytest.raises(ApiError, match="refused too often"):
        limits.precheck("a")
    assert limits.report("a")["refused"] == 3
    # A 429 over the queued tokens came after the prompt was read and tokenized: it draws too.
    queued = AdmissionLimits({"q": TenantLimits(4, 100, refusal_burst=2)}, clock=clock)
    queued.acquire("q", 90)
    for _ in range(2):
        with pytest.raises(ApiError, match="would exceed the limit of 100"):
            queued.acquire("q", 20)
    with pytest.raises(ApiError, match="refused too often"):
        queued.precheck("q")


def test_tenants_file_carries_limits_and_refuses_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    entry = {"name": "a", "keys": [KEY], "limits": {"max_concurrent": 3, "max_queued_tokens": 9}}
    others = [
        {"name": "b", "keys": [KEY[:-1] + "1"]},
        {"name": "c", "keys": [KEY[:-1] + "2"], "limits": "unlimited"},
        {"name": "d", "keys": [KEY[:-1] + "3"], "limits": {"max_queued_tokens": None}},
    ]
    path.write_text(json.dumps({"tenants": [entry, *others]}))
    registry = TenantRegistry.from_file(path)
    assert registry.limits() == {
        "a": TenantLimits(3, 9),
        "b": TenantLimits(),  # no block: the server's defaults
        "c": TenantLimits.unlimited(),
        "d": TenantLimits(max_queued_tokens=None),
    }
    path.write_text(registry.to_json())  # what a hub or a worker reads back
    assert TenantRegistry.from_file(path).limits() == registry.limits()
    assert "limits" not in json.loads(registry.to_json())["tenants"][1]
    bad_limits: tuple[object, ...] = (
        {"max_concurrent": 0}, {"max_concurrent": "3"}, {"burst": 1}, [], "none",
        {"max_concurrent": "default"}, {"retry_after_s": None}, {"refusals_per_s": 0},
    )  # fmt: skip
    for bad in bad_limits:
        path.write_text(json.dumps({"tenants": [{**entry, "limits": bad}]}))
        with pytest.raises(TenantFileError, match=r"tenants\[0\].*limits"):
            TenantRegistry.from_file(path)


def test_the_stack_keeps_sglang_routers_breaker_shut_and_tries_once() -> None:
    """As sglang-router's own argument parser reads them; a later argument overrides them."""
    base = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "2", "--decode"]
    args = parse([*base, "http://127.0.0.1:3", *ROUTER_FAILURE_ARGS])
    assert args.cb_failure_threshold == 2**32 - 1 and args.retry_max_retries == 1
    again = parse(
        [*base, "http://127.0.0.1:3", *ROUTER_FAILURE_ARGS, "--cb-failure-threshold", "10"]
    )
    assert again.cb_failure_threshold == 10
