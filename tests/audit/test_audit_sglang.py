"""The SGLang adapter against 0.5.23's and 0.4.6's real shapes (fixtures/sglang/README.md).

Each test that guards against a wrong pass also shows the check can fail (or
that the old reading would have passed), on the same fixture.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from audit_replay import FIXTURES, ReplayServer, Route
from sglang_worker import SglangWorker, WorkerSpec

from kvfence.audit.base import Budget, Verdict
from kvfence.audit.checks.boundary.check import BoundaryCheck
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.checks.counters.check import CountersCheck
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.base import Endpoints
from kvfence.audit.targets.registry import detect, make_target
from kvfence.audit.targets.sglang import SglangTarget

SGL = FIXTURES / "sglang"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((SGL / name).read_text())
    return data


def serve_node(
    replay: ReplayServer, stem: str, models: str, info: dict[str, Any] | None = None
) -> None:
    replay.json("/server_info", info if info is not None else load(f"{stem}.server_info.json"))
    metrics = SGL / f"{stem}.metrics.txt"
    if metrics.exists():
        replay.routes[("GET", "/metrics")] = Route(200, metrics.read_text(), "text/plain")
    replay.json("/v1/models", load(models))


@pytest.fixture
def client(replay: ReplayServer) -> Iterator[ProbeClient]:
    c = ProbeClient(replay.url, api_key=None, budget=Budget(max_requests=60))
    yield c
    c.close()


def capacity(url: str, headroom: float = 1.25) -> Any:
    ctx = AuditContext(headroom=headroom)
    with ctx.open():
        return run_check(CapacityCheck(), ctx, SglangTarget(url))


def test_unified_node_facts_and_the_0_5_23_length_rule(
    replay: ReplayServer, client: ProbeClient
) -> None:
    serve_node(replay, "0.5.23-unified", "0.5.23-unified.models.json")
    target = detect(replay.url, client)
    assert target.engine == "sglang"
    facts = target.facts(client)
    assert facts.pool_tokens.value == 400000
    assert "memory_usage.token_capacity" in facts.pool_tokens.source
    assert facts.context_length.value == 32768
    # max_req_input_len = min(32767, 399999) - 5 = 32762; rejected at >= 32762
    assert facts.max_input.value == 32761
    assert "0.5.23" in facts.max_input.note and "max_req_input_len" in facts.max_input.note
    assert facts.extra["pd_role"].value == "unified"
    assert facts.prefix_caching.value is True
    assert facts.cache_salt_supported.value is True
    assert facts.counters == {}  # a unified node exports no PD counters: nothing to be unreadable
    assert capacity(replay.url).verdict is Verdict.PASS


def test_dp_attention_rank_with_a_short_pool_fails_the_gate(replay: ReplayServer) -> None:
    stem = "0.5.23-pd-prefill-dp-attention"
    info = load(f"{stem}.server_info.json")
    assert info["dp_size"] == 1 and info["attn_dp_size"] == 4
    serve_node(replay, stem, "0.5.23-pd.models.json", info)
    res = capacity(replay.url)
    assert res.verdict is Verdict.FAIL
    assert res.evidence["pool_tokens"]["value"] == 98304
    assert "rank 2" in res.evidence["pool_tokens"]["note"]
    # The top level (rank 0's 700,000) alone would have passed: that was the wrong pass.
    assert info["max_total_num_tokens"] >= 131072 * 1.25
    # And with every rank large, the same node passes (the check is not stuck on fail).
    for st in info["internal_states"]:
        st["memory_usage"]["token_capacity"] = 700000
    replay.json("/server_info", info)
    replay.routes.pop(("GET", "/metrics"))
    assert capacity(replay.url).verdict is Verdict.PASS


def test_a_rank_without_its_pool_is_never_a_pass(replay: ReplayServer) -> None:
    info = load("0.5.23-pd-prefill-dp-attention.server_info.json")
    del info["internal_states"][3]["memory_usage"]
    serve_node(replay, "0.5.23-pd-prefill-dp-attention", "0.5.23-pd.models.json", info)
    res = capacity(replay.url, headroom=1.0)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "[3]" in res.summary


def test_a_decode_only_target_is_never_a_capacity_pass(
    replay: ReplayServer, client: ProbeClient
) -> None:
    serve_node(replay, "0.5.23-pd-decode", "0.5.23-pd.models.json")
    facts = make_target(replay.url, "sglang", client).facts(client)
    assert facts.pool_tokens.value == 1200000  # large enough — and still no pass
    assert facts.extra["pd_role"].value == "decode"
    assert facts.prefix_caching.value is False  # disaggregation_decode_enable_radix_cache
    assert facts.extra["disaggregation_enable_kv_checksum"].value is False
    assert facts.counters["sglang:num_transfer_failed_reqs_total"].value == 2
    assert facts.counters["sglang:num_bootstrap_failed_reqs_total"].value == 1
    res = capacity(replay.url, headroom=1.0)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "decode node" in res.summary


def counters_around(replay: ReplayServer, after_metrics: str | None) -> Any:
    """Snapshot the counters, swap /metrics to `after_metrics` (None: stop answering), compare."""
    ctx = AuditContext()
    check = CountersCheck()
    target = SglangTarget(replay.url)
    with ctx.open():
        target.facts(ctx.client(target, "a"))
        check.snapshot(ctx, target)
        if after_metrics is None:
            replay.routes.pop(("GET", "/metrics"))
        else:
            replay.routes[("GET", "/metrics")] = Route(200, after_metrics, "text/plain")
        return run_check(check, ctx, target)


def test_decode_side_transfer_failures_fail_the_counters_check(replay: ReplayServer) -> None:
    serve_node(replay, "0.5.23-pd-decode", "0.5.23-pd.models.json")
    text = (SGL / "0.5.23-pd-decode.metrics.txt").read_text()
    unchanged = counters_around(replay, text)
    assert unchanged.verdict is Verdict.PASS
    moved = re.sub(r"(sglang:num_transfer_failed_reqs_total\{[^}]*\}) 2\.0", r"\1 5.0", text)
    assert moved != text
    res = counters_around(replay, moved)
    assert res.verdict is Verdict.FAIL
    assert "num_transfer_failed_reqs_total 2 → 5" in res.summary


def test_a_pd_node_without_metrics_has_unreadable_counters(replay: ReplayServer) -> None:
    info = load("0.5.23-pd-decode.server_info.json")
    replay.json("/server_info", info)
    replay.json("/v1/models", load("0.5.23-pd.models.json"))
    ctx = AuditContext()
    check = CountersCheck()
    target = SglangTarget(replay.url)
    with ctx.open():
        check.snapshot(ctx, target)
        res = run_check(check, ctx, target)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "num_transfer_failed_reqs_total" in res.summary


def test_0_4_6_reports_rank_0_only(replay: ReplayServer, client: ProbeClient) -> None:
    info = load("0.4.6-dp2.get_server_info.json")
    replay.json("/get_server_info", info)
    replay.json("/v1/models", load("0.4.6.models.json"))
    target = detect(replay.url, client)
    assert target.engine == "sglang"
    facts = target.facts(client)
    assert facts.engine.source == "GET /get_server_info"
    assert not facts.pool_tokens.known  # two DP ranks, only rank 0's pool is reported
    assert "rank 0" in facts.pool_tokens.note
    assert facts.context_length.value == 8192
    assert facts.max_input.value == info["max_req_input_len"] - 1
    assert "0.4.6" in facts.max_input.note and ">= context_len (0.4.6)" in facts.max_input.note
    assert facts.prefix_caching.value is False
    assert not facts.cache_salt_supported.known
    assert capacity(replay.url).verdict is Verdict.INCONCLUSIVE


def test_0_4_6_with_one_rank_gates_on_its_top_level_pool(replay: ReplayServer) -> None:
    info = load("0.4.6-dp2.get_server_info.json") | {"dp_size": 1}
    replay.json("/get_server_info", info)
    replay.json("/v1/models", load("0.4.6.models.json"))
    res = capacity(replay.url)
    assert res.verdict is Verdict.PASS
    assert res.evidence["pool_tokens"]["value"] == 240000


def test_a_router_is_not_taken_for_a_worker(replay: ReplayServer, client: ProbeClient) -> None:
    replay.json(
        "/get_server_info", {"router_manager": True, "routers_count": 1, "workers_count": 3}
    )
    assert SglangTarget.identify(Endpoints(client)) is None


@pytest.mark.parametrize("enforces", [True, False])
def test_boundary_on_a_0_5_23_shaped_server_is_decisive(enforces: bool, tmp_path: Any) -> None:
    spec = WorkerSpec("null", [6000], 2048, str(tmp_path))
    worker = SglangWorker(spec)
    if not enforces:  # a server that lets over-long prompts through must fail the check
        spec.context_len = 10**6
        spec.capacities = [10**6]
    try:
        ctx = AuditContext(budget=Budget(max_requests=60))
        target = SglangTarget(worker.url)
        with ctx.open():
            facts = target.facts(ctx.client(target, "a"))
            if not enforces:
                assert facts.max_input.value == 10**6 - 7
                facts.max_input = type(facts.max_input)(2048 - 7, "test: the advertised limit")
            res = run_check(BoundaryCheck(), ctx, target)
    finally:
        worker.close()
    rungs = {r["rung"]: r for r in res.evidence["rungs"]}
    assert rungs["at limit"]["tokens"] == 2048 - 7
    if enforces:
        assert res.verdict is Verdict.PASS, res.summary
    else:
        assert res.verdict is Verdict.FAIL
        assert rungs["limit + 1"]["verdict"] == "fail"


def test_boundary_with_unequal_dp_ranks_is_no_false_alarm(tmp_path: Any) -> None:
    """Rank 1 takes up to 4,089 tokens, rank 0 up to 2,993: a prompt in between is legitimately
    taken by rank 1. The reject rung sits above every rank's limit, "at limit" below all."""
    spec = WorkerSpec("prefill", [3000, 8192], 4096, str(tmp_path), dp_balance="most_free")
    worker = SglangWorker(spec)
    try:
        ctx = AuditContext(budget=Budget(max_requests=60))
        target = SglangTarget(worker.url)
        with ctx.open():
            facts = target.facts(ctx.client(target, "a"))
            res = run_check(BoundaryCheck(), ctx, target)
    finally:
        worker.close()
    assert res.verdict is Verdict.PASS, res.summary  # with one limit + 1 rung: a false FAIL
    assert facts.max_input.value == 3000 - 7
    assert facts.extra["max_input_most"].value == 4096 - 7
    rungs = {r["rung"]: r for r in res.evidence["rungs"]}
    assert rungs["at limit"]["tokens"] == 2993
    assert rungs["above every limit"]["tokens"] == 4090
