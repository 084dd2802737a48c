"""A real vLLM prefill/decode fleet whose transfer leases run out: honest traffic, foreign KV.

vLLM 0.32's prefill keeps a request's blocks for decode only for a lease
(`kv_lease_duration`); when it runs out the blocks go back to the pool while decode may
still read them, and nothing checks the read. This fleet is sized so that one request at
the input limit fills either server's pool (9 blocks of 128 tokens, the null block
included) and its lease is 1 s, which decode's heartbeats cannot extend (1 * 2 // 3 = 0).
A long decode then keeps tenant A's request waiting at decode past its lease, tenant B's
request (same first blocks, same last token) is prefilled into A's freed block, and
decode answers A, through vllm-router, with B's continuation. The lease-reuse probe must
show that, and the counters check must name the prefill counters that moved.
"""

from __future__ import annotations

import time

import httpx
import pytest
from bench.peers.pd_fleet import VllmPdFleet
from peer_helpers import LEASE_PD, PEER_TIMEOUT

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.canary.lease_reuse import LeaseReuseCheck
from kvfence.audit.checks.counters.check import CountersCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.base import parse_prometheus, samples_named
from kvfence.audit.targets.registry import detect

pytestmark = [pytest.mark.slow, pytest.mark.peers, PEER_TIMEOUT]

AFTER_EXPIRY = "vllm:nixl_num_notifications_after_expiry"


@pytest.fixture(scope="module")
def probed(vllm_pd_lease: VllmPdFleet) -> tuple[CheckResult, CheckResult, dict[str, int]]:
    """One audit of the router: counters snapshot, the lease-reuse probe, counters again.

    Returns (probe, counters, prefill's NIXL counters at the end)."""
    ctx = AuditContext(
        key_a="tenant-a",
        key_b="tenant-b",
        budget=Budget(max_requests=3000, max_seconds=900),
        seed=11,
    )
    counters = CountersCheck()
    with ctx.open():
        target = detect(vllm_pd_lease.url, ctx.client_for_url(vllm_pd_lease.url, "a"))
        counters.snapshot(ctx, target)
        probe = run_check(LeaseReuseCheck(), ctx, target)
        after = _published_after_expiry(vllm_pd_lease)
        moved = run_check(counters, ctx, target)
    return probe, moved, after


def _prefill_counters(fleet: VllmPdFleet) -> dict[str, int]:
    text = httpx.get(fleet.prefill.url + "/metrics", timeout=60).text
    samples = parse_prometheus(text)
    return {
        name: int(sum(s.value for s in samples_named(samples, name + "_total")))
        for name in ("vllm:nixl_num_kv_expired_reqs", AFTER_EXPIRY)
    }


def _published_after_expiry(fleet: VllmPdFleet) -> dict[str, int]:
    """Prefill publishes its NIXL counts when it next runs a step: nudge it with one-token
    requests until the late reads show (bounded: 20 requests, each answered)."""
    seen: dict[str, int] = {}
    for _ in range(20):
        seen = _prefill_counters(fleet)
        if seen[AFTER_EXPIRY] > 0:
            return seen
        r = httpx.post(
            fleet.url + "/v1/completions",
            json={"model": fleet.model, "prompt": "nudge", "max_tokens": 1},
            timeout=120,
        )
        assert r.status_code == 200, r.text[:300]
        time.sleep(0.5)
    pytest.fail(f"prefill never published a read after expiry in 20 requests: {seen}")


def test_decode_answers_an_honest_request_from_another_tenants_kv(
    probed: tuple[CheckResult, CheckResult, dict[str, int]],
) -> None:
    probe, _, _ = probed
    assert probe.verdict is Verdict.FAIL, (probe.summary, probe.evidence)
    trial = next(t for t in probe.evidence["trials"] if t["verdict"].startswith("leak"))
    # By construction: equal-length prompts, the same last token, different last blocks.
    own_a, own_b = trial["own_continuation_a"], trial["own_continuation_b"]
    assert own_a != own_b
    # Whichever of the two decode held past its lease got the other's continuation.
    answers = (trial["a_answer_under_load"], trial["b_answer_under_load"])
    assert answers in ((own_b, own_b), (own_a, own_a)), trial
    assert trial["statuses"] == [200, 200]
    # Every usable block but the last (the null block aside) holds the shared prompt.
    assert probe.evidence["shared_full_blocks"] == LEASE_PD.blocks - 2


def test_the_counters_check_names_the_late_read_and_what_it_means(
    vllm_pd_lease: VllmPdFleet, probed: tuple[CheckResult, CheckResult, dict[str, int]]
) -> None:
    _, counters, after = probed
    assert after["vllm:nixl_num_kv_expired_reqs"] >= 1 and after[AFTER_EXPIRY] >= 1, after
    assert counters.verdict is Verdict.FAIL, counters.summary
    prefill = vllm_pd_lease.prefill.url
    assert f"{prefill} vllm:nixl_num_kv_expired_reqs 0 → " in counters.summary
    assert f"{prefill} {AFTER_EXPIRY} 0 → " in counters.summary
    assert "decode finished reading blocks whose lease had already run out" in counters.summary
    # Decode counts none of these: expiry and late reads are prefill's own counts.
    assert f"{vllm_pd_lease.decode.url} vllm:nixl_num_kv_expired_reqs" not in counters.summary
