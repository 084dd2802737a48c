"""The audit's adapters and deterministic checks against the real peers (vLLM, llama.cpp).

The facts the adapters read over HTTP must agree with what each engine
printed at start-up; the capacity gate must judge them with those numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bench.peers import PeerServer, llamacpp_n_ctx, llamacpp_n_ctx_seq, vllm_pool_tokens
from peer_helpers import LLAMA_CTX, LLAMA_SLOTS, PEER_TIMEOUT, VLLM_BLOCKS, VLLM_MAX_MODEL_LEN

from kvfence.audit.base import Budget, Verdict
from kvfence.audit.checks.boundary.check import BoundaryCheck
from kvfence.audit.checks.canary.check import CanaryCheck
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.base import Target, TargetFacts
from kvfence.audit.targets.registry import detect

pytestmark = [pytest.mark.slow, pytest.mark.peers, PEER_TIMEOUT]


@pytest.fixture
def ctx() -> Iterator[AuditContext]:
    c = AuditContext(budget=Budget(max_requests=400, max_seconds=300))
    with c.open():
        yield c


def _detect(ctx: AuditContext, peer: PeerServer) -> tuple[Target, TargetFacts]:
    target = detect(peer.url, ctx.client_for_url(peer.url, "a"))
    return target, target.facts(ctx.client(target, "a"))


def test_vllm_detected_and_facts_match_its_startup_log(
    vllm_peer: PeerServer, ctx: AuditContext
) -> None:
    target, facts = _detect(ctx, vllm_peer)
    assert target.engine == "vllm", target.detected_by
    assert facts.pool_tokens.value == VLLM_BLOCKS * 128 == vllm_pool_tokens(vllm_peer.log_text())
    assert facts.context_length.value == VLLM_MAX_MODEL_LEN
    assert facts.max_input.value == VLLM_MAX_MODEL_LEN - 1
    assert facts.page_size.value == 128
    assert facts.tokenizer.value == "/tokenize"
    assert facts.model.value == vllm_peer.model


def test_vllm_capacity_and_boundary(vllm_peer: PeerServer, ctx: AuditContext) -> None:
    target, _ = _detect(ctx, vllm_peer)
    capacity = run_check(CapacityCheck(), ctx, target)
    assert capacity.verdict is Verdict.PASS, capacity.summary  # 8,192 >= 2,048 x 1.25
    boundary = run_check(BoundaryCheck(), ctx, target)
    assert boundary.verdict is Verdict.PASS, boundary.summary
    statuses = {r["rung"]: r["status"] for r in boundary.evidence["rungs"]}
    assert statuses["at limit"] == 200 and statuses["limit + 1"] == 400


def test_vllm_capacity_fails_when_the_context_outgrows_the_pool(
    vllm_peer: PeerServer,
) -> None:
    ctx = AuditContext(context_override=8192, budget=Budget(max_requests=50))
    with ctx.open():
        target, _ = _detect(ctx, vllm_peer)
        res = run_check(CapacityCheck(), ctx, target)
    assert res.verdict is Verdict.FAIL
    assert res.evidence["shortfall_tokens"] == 8192 * 5 // 4 - VLLM_BLOCKS * 128


def test_vllm_canary_finds_no_leak(vllm_peer: PeerServer, ctx: AuditContext) -> None:
    target, _ = _detect(ctx, vllm_peer)
    res = run_check(CanaryCheck(), ctx, target)
    assert res.verdict is Verdict.PASS, res.summary


def test_llamacpp_claims_only_the_per_slot_context(
    llamacpp_peer: PeerServer, ctx: AuditContext
) -> None:
    target, facts = _detect(ctx, llamacpp_peer)
    assert target.engine == "llamacpp", target.detected_by
    log = llamacpp_peer.log_text()
    per_slot = llamacpp_n_ctx_seq(log) or LLAMA_CTX // LLAMA_SLOTS
    assert llamacpp_n_ctx(log) == LLAMA_CTX
    # The adapter must not claim the whole -c pool: HTTP cannot tell shared from split slots.
    assert facts.pool_tokens.value == per_slot
    assert "lower bound" in facts.pool_tokens.source
    assert facts.extra["total_slots"].value == LLAMA_SLOTS
    res = run_check(CapacityCheck(), ctx, target)
    assert res.verdict is Verdict.FAIL  # a slot's pool equals its context: no headroom


def test_llamacpp_boundary_and_canary(llamacpp_peer: PeerServer, ctx: AuditContext) -> None:
    target, _ = _detect(ctx, llamacpp_peer)
    boundary = run_check(BoundaryCheck(), ctx, target)
    statuses = {r["rung"]: r["status"] for r in boundary.evidence["rungs"]}
    assert boundary.verdict is Verdict.PASS, (boundary.summary, statuses)
    assert statuses["at limit"] == 200 and statuses["limit + 1"] == 400
    canary = run_check(CanaryCheck(), ctx, target)
    assert canary.verdict is Verdict.PASS, canary.summary
