"""`kvfence watch --once` against the real peers: the facts and the gate the audit reports.

vLLM: its pool as its start-up log states it ("CPU KV cache size: N tokens"),
the gate and boundary as `kvfence audit` grades them, exit 0. llama.cpp: the
shared-slot trap — the per-slot n_ctx is reported as a bound, never as the
pool, and the gate never passes on it (exit 1 at the default headroom, where
even the bound is short; inconclusive at headroom 1.0, never 0). The peers
are the session fixtures the other peer tests share: no extra start-up.
"""

from __future__ import annotations

import re

import pytest
from bench.peers import PeerServer, llamacpp_n_ctx_seq, vllm_pool_tokens
from click.testing import CliRunner, Result
from peer_helpers import LLAMA_CTX, LLAMA_SLOTS, PEER_TIMEOUT, VLLM_MAX_MODEL_LEN

from kvfence.audit.base import Budget, Verdict
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.registry import detect
from kvfence.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.peers, PEER_TIMEOUT]


def watch_once(peer: PeerServer, *args: str) -> Result:
    return CliRunner().invoke(main, ["watch", "--once", "--target", peer.url, *args])


def audit_gate(peer: PeerServer, headroom: float = 1.25) -> tuple[Verdict, str]:
    ctx = AuditContext(headroom=headroom, budget=Budget(max_requests=50, max_seconds=120))
    with ctx.open():
        target = detect(peer.url, ctx.client_for_url(peer.url, "a"))
        res = run_check(CapacityCheck(), ctx, target)
    return res.verdict, res.summary


def line(out: str, prefix: str) -> str:
    found = [ln.strip() for ln in out.splitlines() if ln.strip().startswith(prefix)]
    assert found, f"no '{prefix}' line in:\n{out}"
    return found[0]


def test_watch_once_on_vllm_reports_the_pool_its_log_states(vllm_peer: PeerServer) -> None:
    result = watch_once(vllm_peer)
    out = result.output
    print(f"\nwatch --once vLLM (exit {result.exit_code}):\n{out}")
    pool = vllm_pool_tokens(vllm_peer.log_text())
    assert pool is not None
    verdict, summary = audit_gate(vllm_peer)
    assert verdict is Verdict.PASS
    assert line(out, "capacity:") == f"capacity: pass: {summary}"  # the audit's own words
    assert f"pool {pool:,} ≥ context {VLLM_MAX_MODEL_LEN:,}" in summary
    assert line(out, "pool_tokens:").startswith(f"pool_tokens: {pool} (GET /metrics vllm:")
    assert line(out, "context_length:").startswith(f"context_length: {VLLM_MAX_MODEL_LEN} (")
    assert line(out, "boundary:").startswith("boundary: pass:")
    assert re.search(r"no crossing", out), out
    assert result.exit_code == 0, out
    assert line(out, vllm_peer.url).startswith(f"{vllm_peer.url}: pass: facts known")


def test_watch_once_on_llamacpp_never_passes_the_shared_slot_bound(
    llamacpp_peer: PeerServer,
) -> None:
    per_slot = llamacpp_n_ctx_seq(llamacpp_peer.log_text()) or LLAMA_CTX // LLAMA_SLOTS
    result = watch_once(llamacpp_peer, "--no-timing")
    out = result.output
    print(f"\nwatch --once llama.cpp (exit {result.exit_code}):\n{out}")
    verdict, summary = audit_gate(llamacpp_peer)
    assert verdict is Verdict.FAIL  # even the bound is short of context x 1.25
    assert line(out, "capacity:") == f"capacity: fail: {summary}"
    assert f"pool {per_slot:,} <" in summary and "only a bound" in summary
    pool_line = line(out, "pool_tokens:")
    assert pool_line.startswith(f"pool_tokens: {per_slot} (") and "(lower bound)" in pool_line
    assert result.exit_code == 1, out
    # At headroom 1.0 the bound equals the context: the gate still cannot pass on it.
    result = watch_once(llamacpp_peer, "--no-timing", "--no-canary", "--headroom", "1.0")
    verdict, summary = audit_gate(llamacpp_peer, headroom=1.0)
    assert verdict is Verdict.INCONCLUSIVE and "bound" in summary
    assert line(result.output, "capacity:") == f"capacity: inconclusive: {summary}"
    assert result.exit_code == 2, result.output
    print(f"headroom 1.0 (exit {result.exit_code}):\n{result.output}")


def test_the_guard_reads_vllms_own_ttft_and_prefill_histograms(vllm_peer: PeerServer) -> None:
    """An interval's delta of vLLM's histograms is exactly the guard's timing round (no other
    traffic), and vLLM's clock (no network) is never slower than the guard's."""
    from kvfence.watch.guard import GuardConfig, Keys, TargetGuard
    from kvfence.watch.metrics import WatchMetrics
    from kvfence.watch.probes import ROUND

    config = GuardConfig(interval_s=1.0, canary=False, max_target_share=1.0)
    guard = TargetGuard(vllm_peer.url, "vllm", Keys(None, None, None), config, WatchMetrics())
    try:
        first = guard.cycle()
        before = len(guard.timing.samples)
        second = guard.cycle()
    finally:
        guard.close()
    assert first.facts_known and second.facts_known, (first.error, second.error)
    new = list(guard.timing.samples)[before:]
    assert len(new) == ROUND
    delta = guard.engine_latency.delta
    for metric in ("vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds"):
        assert delta[(metric, "")].count == ROUND, {k: h.count for k, h in delta.items()}
        exported = guard.metrics.registry.get_sample_value(
            "kvfence_guard_engine_latency_observations",
            {"target": guard.url, "metric": metric, "prompt_tokens_le": ""},
        )
        assert exported == ROUND
    h = delta[("vllm:time_to_first_token_seconds", "")]
    first_bucket = next(i for i, c in enumerate(h.cumulative) if c > 0)
    lower = h.edges[first_bucket - 1] if first_bucket else 0.0
    assert lower <= min(s.seconds for s in new)
    # Not labelled by prompt length: exported only, no long-bucket evidence.
    assert guard.engine_latency.long_bucket(max(s.prompt_tokens for s in new)) is None
