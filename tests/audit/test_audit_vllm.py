"""The vLLM adapter against 0.32's metrics (fixtures/vllm/README.md says which were captured
live and which written from its source): one engine, data parallel, hybrid, NIXL prefill and
decode (live, idle and after traffic through vllm-router)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from audit_replay import FIXTURES, ReplayServer, Route

from kvfence.audit.base import Budget, Verdict
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.checks.counters.check import CountersCheck
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.registry import detect
from kvfence.audit.targets.vllm import VllmTarget

VLLM = FIXTURES / "vllm"


def serve(replay: ReplayServer, metrics: str, max_model_len: int = 2048) -> None:
    replay.routes[("GET", "/metrics")] = Route(200, (VLLM / metrics).read_text(), "text/plain")
    models = json.loads((VLLM / "0.32.0.models.json").read_text())
    models["data"][0]["max_model_len"] = max_model_len
    replay.json("/v1/models", models)


def serve_nixl(replay: ReplayServer, metrics: str) -> None:
    """A node of the live P/D fleet as it answered: its /metrics and the fleet's /v1/models
    (max_model_len 1024; 16 blocks of 128 tokens per server, the null block among them)."""
    replay.file("/metrics", f"vllm/{metrics}")
    replay.file("/v1/models", "vllm/0.32.0-nixl.models.json")


@pytest.fixture
def client(replay: ReplayServer) -> Iterator[ProbeClient]:
    c = ProbeClient(replay.url, api_key=None, budget=Budget(max_requests=50))
    yield c
    c.close()


def capacity(url: str, headroom: float = 1.25) -> Any:
    ctx = AuditContext(headroom=headroom)
    with ctx.open():
        return run_check(CapacityCheck(), ctx, VllmTarget(url))


def test_one_engine_as_captured_live(replay: ReplayServer, client: ProbeClient) -> None:
    serve(replay, "0.32.0-single.metrics.txt")
    replay.json("/tokenize", {"count": 2, "max_model_len": 2048, "tokens": [1, 2]}, method="POST")
    target = detect(replay.url, client)
    assert target.engine == "vllm"
    facts = target.facts(client)
    assert facts.pool_tokens.value == 64 * 128
    assert "kv_cache_size_tokens" in facts.pool_tokens.source
    assert "guarantee" in facts.pool_tokens.note
    assert facts.page_size.value == 128
    assert facts.context_length.value == 2048
    assert facts.max_input.value == 2047
    assert facts.prefix_caching.value is True
    assert facts.tokenizer.value == "/tokenize"
    assert facts.extra["kv_cache_max_concurrency"].value == 4.0
    assert "pd_role" not in facts.extra  # no KV transfer in its metrics
    assert target.read_counters(client) == {}


def test_data_parallel_engines_are_never_a_pass(replay: ReplayServer, client: ProbeClient) -> None:
    """Captured live with --data-parallel-size 2 and 64 blocks per engine: both series say
    num_gpu_blocks=128 (the sum) and kv_cache_size_tokens=8192 (one engine's), differing only
    in `engine`. Nothing in them names either engine's own pool, so a short engine could hide
    behind the other's figure: the pool is unknown, never a pass."""
    serve(replay, "0.32.0-dp2.metrics.txt")
    replay.file("/v1/models", "vllm/0.32.0-dp2.models.json")
    facts = VllmTarget(replay.url).facts(client)
    assert not facts.pool_tokens.known
    assert "sum over engines" in facts.pool_tokens.note
    assert "num_gpu_blocks=128" in facts.pool_tokens.note
    assert facts.extra["data_parallel_engines"].value == 2
    res = capacity(replay.url)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "data-parallel" in res.summary


def test_hybrid_model_is_gated_on_kv_cache_size_tokens(replay: ReplayServer) -> None:
    """Captured live on a Mamba2 + attention model (vLLM's own sizing of a 1 GiB pool):
    16,384 blocks x 128 = 2,097,152 tokens, but the group-aware kv_cache_size_tokens is
    1,342,177. Served with a max_model_len of 1,100,000 the need (1,375,000) lies between
    the two: blocks x block size would pass, the pool requests can use fails."""
    serve(replay, "0.32.0-hybrid.metrics.txt", max_model_len=1_100_000)
    res = capacity(replay.url)
    assert res.verdict is Verdict.FAIL, res.summary
    assert res.evidence["pool_tokens"]["value"] == 1_342_177
    assert "2097152" in res.evidence["pool_tokens"]["note"]
    assert capacity(replay.url, headroom=1.2).verdict is Verdict.PASS  # needs 1,320,000


def test_hybrid_model_as_captured_passes_at_its_own_length(replay: ReplayServer) -> None:
    serve(replay, "0.32.0-hybrid.metrics.txt")
    replay.file("/v1/models", "vllm/0.32.0-hybrid.models.json")
    res = capacity(replay.url)
    assert res.verdict is Verdict.PASS, res.summary
    assert res.evidence["pool_tokens"]["value"] == 1_342_177


def test_hybrid_without_kv_cache_size_tokens_is_unknown(replay: ReplayServer) -> None:
    serve(replay, "0.32.0-hybrid.metrics.txt")
    text = (VLLM / "0.32.0-hybrid.metrics.txt").read_text()
    text = re.sub(r'kv_cache_size_tokens="\d+",', "", text)
    replay.routes[("GET", "/metrics")] = Route(200, text, "text/plain")
    assert capacity(replay.url, headroom=1.0).verdict is Verdict.INCONCLUSIVE


@pytest.mark.parametrize("traffic", ["", "-traffic"])
@pytest.mark.parametrize(("fixture", "role"), [("prefill", "prefill"), ("decode", "decode")])
def test_a_nixl_node_is_reported_as_pd_with_its_role(
    fixture: str, role: str, traffic: str, replay: ReplayServer, client: ProbeClient
) -> None:
    serve_nixl(replay, f"0.32.0-nixl-{fixture}{traffic}.metrics.txt")
    facts = VllmTarget(replay.url).facts(client)
    assert facts.pool_tokens.value == 16 * 128 and facts.context_length.value == 1024
    assert facts.extra["pd_role"].value == role
    assert facts.extra["kv_transfer"].value == "NIXL"
    assert facts.counters["vllm:nixl_num_failed_transfers"].value == 0
    assert set(facts.counters) >= {
        "vllm:nixl_num_kv_expired_reqs",
        "vllm:nixl_num_notifications_after_expiry",
    }
    verdict = capacity(replay.url).verdict
    assert verdict is (Verdict.INCONCLUSIVE if role == "decode" else Verdict.PASS)


def test_the_live_prefill_pool_fails_where_it_is_short(replay: ReplayServer) -> None:
    """The fleet's own bytes: 2,048 tokens, 1,920 usable past the null block. At headroom 1.9
    the need (1,946) is below the stated size but above what requests can use."""
    serve_nixl(replay, "0.32.0-nixl-prefill.metrics.txt")
    assert capacity(replay.url, headroom=1.875).verdict is Verdict.PASS  # needs exactly 1,920
    res = capacity(replay.url, headroom=1.9)
    assert res.verdict is Verdict.FAIL, res.summary
    assert "1,920 usable < 1,946, short by 26 tokens" in res.summary


def test_honest_traffic_through_the_live_fleet_moves_no_failure_counter(
    replay: ReplayServer,
) -> None:
    """Idle, then after three completions through vllm-router: decode pulled KV three times
    (vllm:nixl_num_descriptors_count 0 -> 3) and no failure counter moved: no false alarm."""
    for role in ("prefill", "decode"):
        idle = (VLLM / f"0.32.0-nixl-{role}.metrics.txt").read_text()
        after = (VLLM / f"0.32.0-nixl-{role}-traffic.metrics.txt").read_text()
        ctx = AuditContext()
        check = CountersCheck()
        target = VllmTarget(replay.url)
        with ctx.open():
            replay.routes[("GET", "/metrics")] = Route(200, idle, "text/plain")
            check.snapshot(ctx, target)
            replay.routes[("GET", "/metrics")] = Route(200, after, "text/plain")
            res = run_check(check, ctx, target)
        assert res.verdict is Verdict.PASS, (role, res.summary)
    pulled = 'vllm:nixl_num_descriptors_count{engine="0",model_name="tiny"} 3.0'
    assert pulled in (VLLM / "0.32.0-nixl-decode-traffic.metrics.txt").read_text()


def test_nixl_transfer_failures_during_the_audit_fail_counters(replay: ReplayServer) -> None:
    serve_nixl(replay, "0.32.0-nixl-decode.metrics.txt")
    ctx = AuditContext()
    check = CountersCheck()
    target = VllmTarget(replay.url)
    with ctx.open():
        check.snapshot(ctx, target)
        assert run_check(check, ctx, target).verdict is Verdict.PASS
        text = (VLLM / "0.32.0-nixl-decode.metrics.txt").read_text()
        moved = re.sub(r"(vllm:nixl_num_failed_transfers_total\{[^}]*\}) 0\.0", r"\1 3.0", text)
        assert moved != text
        replay.routes[("GET", "/metrics")] = Route(200, moved, "text/plain")
        res = run_check(check, ctx, target)
    assert res.verdict is Verdict.FAIL
    assert "vllm:nixl_num_failed_transfers 0 → 3" in res.summary
