"""Prefix sharing and noninterference against real vLLM (CPU) on the tiny checkpoint.

vLLM's default configuration (prefix caching on, no salt) shares its prefix
cache across every caller: the check must fail it, by `cached_tokens` at once
and by timing alone through the sequential KS test. Per-tenant `cache_salt`
isolates it: the salted run must pass, with the same-salt control hitting.
They run on the session's vLLM (`vllm_peer`: 64 blocks of 128 tokens, max_model_len
2048), which holds a 1,920-token prefix four times over.
"""

from __future__ import annotations

import pytest
from bench.peers import PeerServer
from peer_helpers import PEER_TIMEOUT

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.noninterference.check import NoninterferenceCheck, NoninterferenceConfig
from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.stats import SequentialDesign
from kvfence.audit.targets.vllm import VllmTarget

pytestmark = [pytest.mark.slow, pytest.mark.peers, PEER_TIMEOUT]


def _run(server: PeerServer, check: object, seed: int = 0) -> CheckResult:
    # vLLM has no tenants: A and B are two callers of the same open endpoint.
    ctx = AuditContext(seed=seed, budget=Budget(max_requests=3000, max_seconds=300))
    with ctx.open():
        return run_check(check, ctx, VllmTarget(server.url))  # type: ignore[arg-type]


def test_vllm_default_fails_prefix_sharing_and_cache_salt_isolates(vllm_peer: PeerServer) -> None:
    res = _run(vllm_peer, PrefixSharingCheck(PrefixSharingConfig(salt="auto")))
    assert res.verdict is Verdict.FAIL, res.summary
    unsalted, salted = res.evidence["unsalted"], res.evidence["salted"]
    assert unsalted["cross_tenant_cached_hits"] >= 1
    # Whole 128-token blocks of the prefix (16 blocks, 15 fit max_model_len 2048) come back.
    assert res.evidence["prefix_tokens"] == 1920
    assert unsalted["cross_tenant_hit_examples"][0]["cached_tokens"] >= 128
    assert salted["verdict"] == "pass", salted
    assert salted["cross_tenant_cached_hits"] == 0
    assert salted["same_salt_control"]["hit_by_cached_tokens"] is True
    print(f"\nvLLM default: fail after {unsalted['requests']} requests; salted: pass")


def test_vllm_default_fails_prefix_sharing_by_timing_alone(vllm_peer: PeerServer) -> None:
    cfg = PrefixSharingConfig(
        salt="off",
        stop_on_cached_evidence=False,
        design=SequentialDesign(alpha=1e-6, batch=8, max_per_arm=64),
    )
    res = _run(vllm_peer, PrefixSharingCheck(cfg), seed=1)
    assert res.verdict is Verdict.FAIL, res.summary
    ks = res.evidence["unsalted"]["ks"]
    assert ks["rejected"] and ks["p_value"] < 1e-6 / 8
    print(f"\nvLLM timing only: p = {ks['p_value']:.2e} after {res.evidence['requests']} requests")


def test_vllm_fails_prefix_sharing_at_alpha_1e_9_by_timing_alone(vllm_peer: PeerServer) -> None:
    """`kvfence audit --alpha 1e-9`'s design (the audit's share, the prefix grown with the
    evidence asked for): vLLM's shared cache fails by timing alone, below 1e-9."""
    cfg = PrefixSharingConfig(salt="off", stop_on_cached_evidence=False)
    budget = Budget(max_requests=3000, max_seconds=300)
    # As `kvfence audit --checks prefix_sharing --alpha 1e-9`: the whole alpha is this check's.
    ctx = AuditContext(seed=2, alpha=1e-9, statistical=("prefix_sharing",), budget=budget)
    with ctx.open():
        res = run_check(PrefixSharingCheck(cfg, audit_alpha=True), ctx, VllmTarget(vllm_peer.url))
    assert res.verdict is Verdict.FAIL, res.summary
    assert res.p_value is not None and res.p_value < 1e-9 and res.alpha == pytest.approx(1e-9)
    # 2 x 16 of vLLM's 128-token blocks wanted; 15 fit max_model_len 2048.
    assert res.evidence["prefix_tokens"] == 1920 and res.evidence["prefix_evidence_scale"] > 2
    print(f"\nvLLM at 1e-9: p = {res.p_value:.2e} after {res.evidence['requests']} requests")


def test_vllm_noninterference_passes(vllm_peer: PeerServer) -> None:
    res = _run(vllm_peer, NoninterferenceCheck(NoninterferenceConfig(repeats=6)))
    assert res.verdict is Verdict.PASS, res.summary
    assert res.evidence["load"]["ok"] > 0
