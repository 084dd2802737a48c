"""Prefix sharing and noninterference against real vLLM (CPU) on the tiny checkpoint.

vLLM's default configuration (prefix caching on, no salt) shares its prefix
cache across every caller: the check must fail it, by `cached_tokens` at once
and by timing alone through the sequential KS test. Per-tenant `cache_salt`
isolates it: the salted run must pass, with the same-salt control hitting.

Needs the peer cache (`make peers`); skips without it unless
KVFENCE_REQUIRE_PEERS=1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.noninterference.check import NoninterferenceCheck, NoninterferenceConfig
from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.stats import SequentialDesign
from kvfence.audit.targets.vllm import VllmTarget

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.peers import PeerCache, PeerServer, start_vllm  # noqa: E402

# vLLM needs about a minute to start on an idle 2-core machine, several on a busy one.
# func_only: vLLM's start-up (a fixture) is bounded by its own wait, which follows the server.
pytestmark = [pytest.mark.slow, pytest.mark.peers, pytest.mark.timeout(900, func_only=True)]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerServer]:
    cache = PeerCache.from_env()
    if not cache.vllm_installed():
        reason = f"vllm peer not installed in {cache.root} (run `make peers`)"
        if os.environ.get("KVFENCE_REQUIRE_PEERS") == "1":
            pytest.fail(reason + "; KVFENCE_REQUIRE_PEERS=1 forbids skipping")
        pytest.skip(reason)
    from kvfence.model.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)
    with start_vllm(
        ckpt,
        max_model_len=2048,
        enable_prompt_tokens_details=True,
        enforce_eager=True,
        log_dir=tmp_path_factory.mktemp("vllm-log"),
        cache=cache,
    ) as server:
        yield server


def _run(server: PeerServer, check: object, seed: int = 0) -> CheckResult:
    # vLLM has no tenants: A and B are two callers of the same open endpoint.
    ctx = AuditContext(seed=seed, budget=Budget(max_requests=3000, max_seconds=300))
    with ctx.open():
        return run_check(check, ctx, VllmTarget(server.url))  # type: ignore[arg-type]


def test_vllm_default_fails_prefix_sharing_and_cache_salt_isolates(vllm: PeerServer) -> None:
    res = _run(vllm, PrefixSharingCheck(PrefixSharingConfig(salt="auto")))
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


def test_vllm_default_fails_prefix_sharing_by_timing_alone(vllm: PeerServer) -> None:
    cfg = PrefixSharingConfig(
        salt="off",
        stop_on_cached_evidence=False,
        design=SequentialDesign(alpha=1e-6, batch=8, max_per_arm=64),
    )
    res = _run(vllm, PrefixSharingCheck(cfg), seed=1)
    assert res.verdict is Verdict.FAIL, res.summary
    ks = res.evidence["unsalted"]["ks"]
    assert ks["rejected"] and ks["p_value"] < 1e-6 / 8
    print(f"\nvLLM timing only: p = {ks['p_value']:.2e} after {res.evidence['requests']} requests")


def test_vllm_fails_prefix_sharing_at_alpha_1e_9_by_timing_alone(vllm: PeerServer) -> None:
    """`kvfence audit --alpha 1e-9`'s design (the audit's share, the prefix grown with the
    evidence asked for): vLLM's shared cache fails by timing alone, below 1e-9."""
    cfg = PrefixSharingConfig(salt="off", stop_on_cached_evidence=False)
    budget = Budget(max_requests=3000, max_seconds=300)
    # As `kvfence audit --checks prefix_sharing --alpha 1e-9`: the whole alpha is this check's.
    ctx = AuditContext(seed=2, alpha=1e-9, statistical=("prefix_sharing",), budget=budget)
    with ctx.open():
        res = run_check(PrefixSharingCheck(cfg, audit_alpha=True), ctx, VllmTarget(vllm.url))
    assert res.verdict is Verdict.FAIL, res.summary
    assert res.p_value is not None and res.p_value < 1e-9 and res.alpha == pytest.approx(1e-9)
    # 2 x 16 of vLLM's 128-token blocks wanted; 15 fit max_model_len 2048.
    assert res.evidence["prefix_tokens"] == 1920 and res.evidence["prefix_evidence_scale"] > 2
    print(f"\nvLLM at 1e-9: p = {res.p_value:.2e} after {res.evidence['requests']} requests")


def test_vllm_noninterference_passes(vllm: PeerServer) -> None:
    res = _run(vllm, NoninterferenceCheck(NoninterferenceConfig(repeats=6)))
    assert res.verdict is Verdict.PASS, res.summary
    assert res.evidence["load"]["ok"] > 0
