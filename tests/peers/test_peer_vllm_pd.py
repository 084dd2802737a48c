"""A real vLLM prefill/decode fleet (NixlConnector on CPU, vllm-router): the transfer-reference hole.

vLLM 0.32's decode server honours any `kv_transfer_params` a client sends: tenant B's prompt
with tenant A's reference is answered from A's KV, and the foreign blocks then sit in
decode's prefix cache under B's tokens. vllm-router overwrites a client's reference, so the
public URL holds; the decode server the router lists does not. The check must say exactly
that, and must stay quiet on a single vLLM, which hands out no reference at all.
"""

from __future__ import annotations

from typing import Any

import pytest
from bench.peers import PeerServer
from bench.peers.pd_fleet import VllmPdFleet
from peer_helpers import PEER_TIMEOUT

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.boundary.check import BoundaryCheck
from kvfence.audit.checks.canary.check import CanaryCheck
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.checks.counters.check import CountersCheck
from kvfence.audit.checks.transfer_reference.check import TransferReferenceCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.registry import detect

pytestmark = [pytest.mark.slow, pytest.mark.peers, PEER_TIMEOUT]


def _run(url: str, workers: tuple[str, ...] = (), seed: int = 0) -> CheckResult:
    ctx = AuditContext(
        key_a="tenant-a",
        key_b="tenant-b",
        budget=Budget(max_requests=200, max_seconds=600),
        seed=seed,
        workers=workers,
    )
    with ctx.open():
        target = detect(url, ctx.client_for_url(url, "a"))
        return run_check(TransferReferenceCheck(), ctx, target)


def _outcomes(res: CheckResult, case: str) -> dict[str, dict[str, Any]]:
    rows = res.evidence["outcomes"]
    assert isinstance(rows, list)
    return {row["route"].split()[0]: row for row in rows if row["case"] == case}


def _explain(res: CheckResult, fleet: VllmPdFleet) -> str:
    """Every outcome on one line, and which of the fleet's processes still run (with the end of
    the log of any that stopped): what a failure on a machine nobody can log into must say."""
    rows = res.evidence["outcomes"]
    assert isinstance(rows, list)
    lines = [f"{res.verdict.value}: {res.summary}"]
    lines += [
        f"  {r['route']} {r['case']}: {r['status']} {r['verdict']} ({r['detail']})" for r in rows
    ]
    for server in fleet.servers:
        lines.append(f"  {server.name}: {'running' if server.alive() else 'EXITED'}")
        if not server.alive():
            lines.append(server.log_tail(30))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def probed(vllm_pd: VllmPdFleet) -> tuple[CheckResult, str]:
    """One run of the check on the fleet, read by the tests below: (result, its explanation).

    The poisoning step runs in the same probe, right after decode took B's foreign reference,
    so one run shows both the hole and what it leaves in the prefix cache."""
    res = _run(vllm_pd.url)
    return res, _explain(res, vllm_pd)


def test_decode_serves_b_from_a_reference_and_the_router_holds(
    vllm_pd: VllmPdFleet, probed: tuple[CheckResult, str]
) -> None:
    res, why = probed
    assert res.verdict is Verdict.FAIL, why
    live = _outcomes(res, "live")
    # The decode server the router lists: B's prompt answered, 200, from KV that is not B's.
    # Here that is A's continuation ("leak": A's, or A's past the point where B's differs
    # before a greedy near-tie broke another way). Where decode's kernels read the pages
    # unlike prefill wrote them, the text may follow neither ("foreign"): still not B's
    # own, and the same FAIL.
    decode = live["decode"]
    assert decode["status"] == 200 and decode["verdict"] in ("leak", "foreign"), why
    assert decode["answer"] != decode["own_continuations"]["B"], why
    if decode["verdict"] == "leak":
        assert decode["answer"][:4] == decode["own_continuations"]["A"][:4], why
    assert vllm_pd.decode.url.split("//")[1] in res.summary  # the leaking route is named
    # Through vllm-router the client's reference is overwritten: B gets its own answer.
    assert live["public"]["verdict"] == "own", why
    assert "off the tenants' network" in str(res.evidence["advice"])


def test_a_poisoned_prefix_reaches_honest_requests_through_the_router(
    probed: tuple[CheckResult, str],
) -> None:
    res, why = probed
    poisoned = _outcomes(res, "poisoned")
    assert poisoned, why
    # No reference in these requests: the foreign KV came out of decode's prefix cache.
    assert poisoned["public"]["verdict"] == "leak", why


def test_the_runbook_reads_each_node_of_the_fleet(vllm_pd: VllmPdFleet) -> None:
    """Capacity, boundary, canary and counters on the live fleet, through vllm-router: the
    facts come from the prefill and decode servers the router lists, each with its source."""
    ctx = AuditContext(key_a="tenant-a", key_b="tenant-b", budget=Budget(400, 600))
    counters = CountersCheck()
    with ctx.open():
        target = detect(vllm_pd.url, ctx.client_for_url(vllm_pd.url, "a"))
        counters.snapshot(ctx, target)
        results = {
            c.name: run_check(c, ctx, target)
            for c in (CapacityCheck(), BoundaryCheck(), CanaryCheck())
        }
        results["counters"] = run_check(counters, ctx, target)
    capacity, boundary = results["capacity"], results["boundary"]
    # The pool is the prefill node's, read from its own metrics (16 blocks of 128 tokens).
    assert capacity.verdict is Verdict.PASS, capacity.summary
    pool = capacity.evidence["pool_tokens"]
    assert isinstance(pool, dict) and pool["value"] == 16 * 128, pool
    assert f"kv_cache_size_tokens on {vllm_pd.prefill.url}" in str(pool["source"]), pool
    assert "vLLM 0.32.0" in str(pool["note"])  # decided by the version's own rules
    # The input limit, from the nodes the router lists: accepted at it, refused past it.
    assert boundary.verdict is Verdict.PASS, boundary.summary
    statuses = {r["rung"]: r["status"] for r in boundary.evidence["rungs"]}
    assert statuses["at limit"] == 200 and statuses["limit + 1"] == 400, statuses
    assert results["canary"].verdict is Verdict.PASS, results["canary"].summary
    # The NIXL failure counters are read on both servers; a move is a FAIL that says what
    # the counter means (an expired lease, a read after it), never a silent pass.
    counters = results["counters"]
    rows = counters.evidence["counters"]
    assert isinstance(rows, list)
    read = {r["counter"] for r in rows}
    for server in (vllm_pd.prefill, vllm_pd.decode):
        assert f"{server.url} vllm:nixl_num_notifications_after_expiry" in read, read
    moved = [r for r in rows if r["before"] != r["after"]]
    assert (counters.verdict is Verdict.FAIL) == bool(moved), (counters.summary, moved)
    if any("after_expiry" in r["counter"] for r in moved):
        assert "decode finished reading blocks whose lease had already run out" in (
            counters.summary
        )


def test_a_single_vllm_hands_out_no_reference(vllm_peer: PeerServer) -> None:
    """No false alarm: a server without a KV connector gives no vLLM reference, and SGLang's
    bootstrap room sent beside it is ignored (B's own text): the check passes, saying both."""
    res = _run(vllm_peer.url)
    assert res.verdict is Verdict.PASS, res.summary
    assert "no route handed tenant A a `kv_transfer_params` reference" in res.summary
    assert "bootstrap-live: own" in res.summary, res.summary
