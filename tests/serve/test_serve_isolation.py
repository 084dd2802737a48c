"""Tenant isolation through the HTTP API: prefix-cache namespaces (I8), concurrency, disconnects."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_helpers import IDLE, TENANTS, Served, serve

from kvfence.faults import Fault, FaultSet
from kvfence.serve.build import PoolSizes


def cached(s: Served, tenant: str, prompt: str, salt: str | None = None) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    r = s.client(tenant).completions.create(
        model=s.model, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return int(r.usage.prompt_tokens_details.cached_tokens or 0)


def long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"word{i}" for i in range(60))  # well over 4 pages


def test_prefix_cache_hits_only_within_tenant_and_salt(mirror: Served) -> None:
    p = long_prompt("prefix-ns-4be1")
    assert cached(mirror, "a", p) == 0
    hit = cached(mirror, "a", p)
    assert hit >= 64  # same tenant, same prompt: full pages come from the cache
    assert cached(mirror, "b", p) == 0  # another tenant never hits a's cache (I8)
    # cache_salt: a new namespace; the same salt hits AND a different salt misses.
    assert cached(mirror, "a", p, salt="salt-1") == 0
    assert cached(mirror, "a", p, salt="salt-1") == hit
    assert cached(mirror, "a", p, salt="salt-2") == 0
    assert cached(mirror, "b", p, salt="salt-1") == 0  # a salt does not cross tenants
    m = mirror.metrics()
    assert m["kvfence_prefix_cache_hit_tokens_total"] >= 2 * hit
    assert (
        m["kvfence_prefix_cache_queried_tokens_total"] > m["kvfence_prefix_cache_hit_tokens_total"]
    )


@pytest.fixture(scope="module")
def shared_cache_lab(checkpoint: Path) -> Iterator[Served]:
    with serve(
        checkpoint,
        pools=PoolSizes(prefill_pages=512, decode_pages=512),
        faults=FaultSet.of(Fault.SHARED_PREFIX_CACHE),
    ) as s:
        yield s


def test_cross_tenant_hit_appears_only_under_the_shared_cache_fault(
    shared_cache_lab: Served,
) -> None:
    p = long_prompt("prefix-shared-77c0")
    assert cached(shared_cache_lab, "a", p) == 0
    assert cached(shared_cache_lab, "b", p) >= 64  # CVE-2025-46570 re-created
    info = shared_cache_lab.info()
    assert info["prefix_cache"]["namespacing"] == "shared"
    assert info["lab"]["faults"] == ["shared-prefix-cache"]


def test_sixteen_concurrent_streams_from_four_tenants_get_their_own_prompt(
    mirror: Served,
) -> None:
    jobs = [
        (TENANTS[i % 4], f"canary-{TENANTS[i % 4]}-{i:02d}-" + "x" * (5 + 7 * i) + f" end{i}")
        for i in range(16)
    ]
    lengths = {
        p: len(mirror.post("/tokenize", json={"prompt": p}).json()["tokens"]) for _, p in jobs
    }
    barrier = threading.Barrier(16)

    def run(job: tuple[str, str]) -> str:
        tenant, prompt = job
        barrier.wait()
        stream = mirror.client(tenant).completions.create(
            model=mirror.model,
            prompt=prompt,
            max_tokens=lengths[prompt],
            temperature=0,
            stream=True,
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(run, jobs))
    for (_, prompt), out in zip(jobs, outputs, strict=True):
        assert out == prompt  # exactly its own prompt, nobody else's
    m = mirror.metrics()
    assert m["kvfence_isolation_violations_total"] == 0
    assert mirror.wait_idle() == IDLE


def test_disconnect_mid_stream_aborts_and_frees_pages(mirror: Served) -> None:
    before = mirror.metrics()
    body = {
        "model": mirror.model,
        "prompt": "disconnect canary 3e9f " * 4,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", mirror.url + "/v1/completions", json=body, headers=mirror.headers(), timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[6:])["choices"][0]["text"]
    # The connection is closed here, with most of the 3000 tokens not yet generated.
    assert mirror.wait_idle() == IDLE
    after = mirror.metrics()
    assert after["kvfence_requests_total{outcome=aborted}"] == (
        before["kvfence_requests_total{outcome=aborted}"] + 1
    )
    generated = after["kvfence_generation_tokens_total"] - before["kvfence_generation_tokens_total"]
    assert generated < 3000


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts(mirror: Served) -> None:
    before = mirror.metrics()
    body = {"model": mirror.model, "prompt": "gone " * 8, "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(mirror.url + "/v1/completions", json=body, headers=mirror.headers(), timeout=0.5)
    assert mirror.wait_idle() == IDLE
    after = mirror.metrics()
    assert after["kvfence_requests_total{outcome=aborted}"] == (
        before["kvfence_requests_total{outcome=aborted}"] + 1
    )
    generated = after["kvfence_generation_tokens_total"] - before["kvfence_generation_tokens_total"]
    assert generated < 3000


def test_abort_mid_stream_ends_with_an_error_event_never_a_finish(mirror: Served) -> None:
    """I6: an operator abort after admission reaches the client as an SSE error, then [DONE]."""
    body = {
        "model": mirror.model,
        "prompt": "operator abort canary " * 4,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", mirror.url + "/v1/completions", json=body, headers=mirror.headers(), timeout=60
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        (room,) = mirror.router.rooms  # the only live request; rooms are never shown to clients
        mirror.parts.pipeline.abort(room, "operator drain")
        rest = [line for line in lines if line]
    events = [json.loads(x[6:]) for x in rest[:-1]]
    assert rest[-1] == "data: [DONE]"
    assert "error" in events[-1] and "operator drain" in events[-1]["error"]["message"]
    assert all(e.get("choices", [{}])[0].get("finish_reason") is None for e in events[:-1])
    assert mirror.wait_idle() == IDLE
