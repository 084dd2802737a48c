"""One test per lab fault switch: the bug's symptom with the switch on, its absence with it off.

Through the public HTTP API (real servers on loopback, real HTTP clients)
wherever the symptom is visible there. Each comparison differs in exactly the
switch under test. What already has a test elsewhere is referenced, not
repeated:

- tests/lab/test_matrix.py: the incident under all 16 subsets of its four
  defences (the leak only with all four off; the error each LAST defence gives).
- tests/serve/test_serve_capacity.py: `kvfence serve` refusing to start on a
  failing gate; the rejected (over-pool) request under `abort-as-success`.
- tests/serve/test_serve_isolation.py: per-tenant / per-salt cache namespaces.
- tests/engine/test_pool.py, test_pool_stateful.py, tests/transfer/
  test_deferred_release.py, tests/engine_runtime/: `no-invalidate`,
  `early-free`, `no-ledger-check`, `decode-trusts-bootstrap` at pool, transport
  and engine level (forged manifests, late writes over real transports).

The four incident switches are shown as a ladder on the incident's scaled
geometry: each step turns one more switch on, and the client sees which
defence now stops tenant B (I4 edge -> I2 engine reject -> I3 reconciliation ->
I1 ledger -> the leak). The undersized pool is the door: without it B's
over-pool prompt never gets past the edge, so no other switch can be seen.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from switch_servers import (
    B_TOKENS,
    SCALE,
    SENTINEL,
    Episode,
    ScaledLab,
    Served,
    roomy_server,
)

from kvfence.engine.backend import GenerateWork
from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import SamplingParams
from kvfence.engine.request import RequestState
from kvfence.engine.sizing import CapacityGateError
from kvfence.faults import POISON_SEED, Fault, FaultSet
from kvfence.kv.pool import BatchPages, IsolationViolation, PageHandle
from kvfence.model.loader import load_model
from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, build_local
from kvfence.serve.pipeline import CollectingSink, LocalPipeline, Result
from kvfence.serve.tenants import TenantRegistry
from kvfence.transfer.link import inprocess_link

pytestmark = pytest.mark.slow  # real servers on loopback

U, ANT, DTB, NLC = (
    Fault.UNDERSIZED_POOL,
    Fault.ABORT_NOT_TERMINAL,
    Fault.DECODE_TRUSTS_BOOTSTRAP,
    Fault.NO_LEDGER_CHECK,
)
POOL = SCALE.prefill_pool_tokens  # 336
REJECTED = "kvfence_rejections_total{reason=context_length_exceeded}"
EDGE_REJECTED = "kvfence_rejections_total{reason=pool_capacity_exceeded}"
MISMATCHES = "kvfence_transfer_mismatches_total"
VIOLATIONS = "kvfence_isolation_violations_total"
PROMPT_TOKENS = "kvfence_prompt_tokens_total"


@pytest.fixture(scope="module")
def lab(lab_checkpoint: Path) -> ScaledLab:
    return ScaledLab(lab_checkpoint)


def episode(lab: ScaledLab, *faults: Fault) -> Episode:
    ep = lab.episode(FaultSet.of(*faults))
    # Every server says which switches are on, so an audit never mistakes it for production.
    assert ep.info["lab"]["faults"] == FaultSet.of(*faults).names()
    assert ep.a_statuses == (200, 200)  # A is always served normally
    assert SENTINEL not in json.dumps(ep.b_body) or ep.b_status == 200
    return ep


# ---- undersized-pool (I4) ---------------------------------------------------------------------


def test_undersized_pool_starts_and_admits_a_prompt_over_the_pool(
    lab: ScaledLab, lab_checkpoint: Path
) -> None:
    # Off, strictly: the same pools and no permission to run undersized -> the server refuses to start.
    parts = build_local(
        LocalSpec(
            lab_checkpoint,
            kind="mirror",
            context_length=SCALE.context_length,
            pools=PoolSizes(prefill_pages=SCALE.prefill_pages, decode_pages=SCALE.decode_pages),
        )
    )
    with pytest.raises(CapacityGateError) as e:
        create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, TenantRegistry.generate())
    assert e.value.report.pool_tokens == POOL and e.value.report.context_length == 512

    # Off, the honest undersized mode: the edge is the pool; B's prompt is refused before the engine.
    off = episode(lab)
    assert off.info["max_req_input_len"] == POOL and off.info["capacity_gate"]["skipped"] is False
    assert off.b_status == 400 and off.error["code"] == "pool_capacity_exceeded"
    assert "max_req_input_len" in off.error["message"] and str(POOL) in off.error["message"]
    assert off.delta(EDGE_REJECTED) == 1 and off.delta(PROMPT_TOKENS) == 0  # nothing computed

    # On: gate skipped (and said so), edge = context; B's over-pool prompt reaches the engine.
    on = episode(lab, U)
    gate = on.info["capacity_gate"]
    assert gate["skipped"] is True and gate["passed"] is False and on.info["undersized_pool"]
    assert on.info["max_req_input_len"] == SCALE.context_length
    assert on.delta(PROMPT_TOKENS) == B_TOKENS and on.delta(EDGE_REJECTED) == 0
    # ...where the remaining defence (I2, the prefill engine's own reject) stops it.
    assert on.b_status == 400 and on.error["code"] == "context_length_exceeded"
    assert f"prefill pool holds at most {POOL} tokens" in on.error["message"]
    assert on.delta(REJECTED) == 1 and on.leaked is None


# ---- abort-not-terminal (I2) ------------------------------------------------------------------


def test_abort_not_terminal_loses_the_rejection_and_the_request_runs_on(lab: ScaledLab) -> None:
    """Off: the engine's 400 reaches B. On: the rejection is stored aside and the request
    goes on, on a 1-token placeholder, into a transfer that I3 then refuses (502)."""
    off = episode(lab, U)
    assert off.b_status == 400 and off.delta(REJECTED) == 1 and off.delta(MISMATCHES) == 0

    on = episode(lab, U, ANT)
    assert on.delta(REJECTED) == 0  # the symptom: the rejection never happened
    assert on.b_status == 502 and on.error["code"] == "transfer_mismatch"
    assert "num_tokens" in on.error["message"]  # 1 placeholder token vs B's reservation
    assert on.delta(MISMATCHES) == 1 and on.delta(VIOLATIONS) == 0 and on.leaked is None


# ---- decode-trusts-bootstrap (I3) -------------------------------------------------------------


def test_decode_trusts_bootstrap_accepts_the_short_transfer(lab: ScaledLab) -> None:
    """Off: reconciliation refuses the 1-token manifest (502). On: the transfer is accepted
    and decode attends every reserved page; the ledger (I1) then fails the read (500)."""
    off = episode(lab, U, ANT)
    assert off.b_status == 502 and off.delta(MISMATCHES) == 1

    on = episode(lab, U, ANT, DTB)
    assert on.delta(MISMATCHES) == 0  # the symptom: the short transfer went through
    assert on.b_status == 500 and "isolation violation" in on.error["message"]
    assert on.delta(VIOLATIONS) == 1 and on.leaked is None


# ---- no-ledger-check (I1) ---------------------------------------------------------------------


def test_no_ledger_check_lets_b_read_a_s_pages(lab: ScaledLab) -> None:
    """Off: the read of pages B never wrote is an isolation violation (500).
    On: the Workers AI leak — HTTP 200, B's own prompt_tokens, A's sentinel in B's text."""
    off = episode(lab, U, ANT, DTB)
    assert off.b_status == 500 and off.delta(VIOLATIONS) == 1 and off.leaked is None

    on = episode(lab, U, ANT, DTB, NLC)
    assert on.b_status == 200 and on.leaked == SENTINEL
    assert on.b_body["usage"]["prompt_tokens"] == on.b_prompt_tokens == B_TOKENS
    assert on.b_body["choices"][0]["finish_reason"] == "length"
    # The server saw nothing wrong: that is the bug.
    assert on.delta(VIOLATIONS) == on.delta(MISMATCHES) == on.delta(REJECTED) == 0


@pytest.mark.parametrize(
    ("switch", "status", "caught_by"),
    [(DTB, 400, REJECTED), (NLC, 400, REJECTED)],
    ids=["decode-trusts-bootstrap", "no-ledger-check"],
)
def test_a_later_defence_switched_off_alone_changes_nothing_visible(
    lab: ScaledLab, switch: Fault, status: int, caught_by: str
) -> None:
    """Each switch alone (behind the open door): I2 rejects B before any transfer or read,
    so the missing defence is never reached — the answer is the baseline's, the same
    counter moves. (`abort-not-terminal` alone is the 502 above: I3 catches it.)"""
    baseline = episode(lab, U)
    ep = episode(lab, U, switch)
    assert ep.b_status == baseline.b_status == status
    assert ep.error["message"] == baseline.error["message"]
    assert ep.delta(caught_by) == 1 and ep.leaked is None
    assert ep.delta(MISMATCHES) == ep.delta(VIOLATIONS) == 0


# ---- abort-as-success (I6) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def production(lab_checkpoint: Path) -> Iterator[Served]:
    with roomy_server(lab_checkpoint, FaultSet()) as s:
        yield s


@pytest.fixture(scope="module")
def abort_as_success(lab_checkpoint: Path) -> Iterator[Served]:
    with roomy_server(lab_checkpoint, FaultSet.of(Fault.ABORT_AS_SUCCESS)) as s:
        yield s


def stream_then_abort(s: Served) -> tuple[int, list[dict[str, object]], dict[str, float]]:
    """A long stream; after its first token the operator aborts it (as `kvfence` does on
    shutdown or a worker's death). Returns status, every SSE object, and the metric moves."""
    before = s.metrics()
    body = {
        "model": s.info()["model"],
        "prompt": "abort canary 51c2 " * 4,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", s.url + "/v1/completions", json=body, headers=s.headers("a"), timeout=60
    ) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        events = [json.loads(next(lines)[6:])]
        (room,) = list(s.router.rooms)  # the one live request
        s.pipeline.abort(room, "operator abort")
        events += [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
        status = r.status_code
    after = s.metrics()
    moved = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("kvfence_requests")}
    return status, events, moved


def test_abort_as_success_reports_an_aborted_stream_as_a_normal_end(
    production: Served, abort_as_success: Served
) -> None:
    assert production.info()["lab"]["faults"] == []
    assert abort_as_success.info()["lab"]["faults"] == ["abort-as-success"]

    status, events, moved = stream_then_abort(production)
    assert status == 200  # headers went out with the first token; the end must say what happened
    assert events[-1]["error"]["type"] == "aborted"  # type: ignore[index]
    assert "operator abort" in events[-1]["error"]["message"]  # type: ignore[index]
    assert moved["kvfence_requests_total{outcome=aborted}"] == 1
    assert moved["kvfence_requests_total{outcome=finished}"] == 0

    status, events, moved = stream_then_abort(abort_as_success)
    # SGLang #33507: the abort dressed as a length-capped answer, far short of max_tokens.
    assert status == 200 and not any("error" in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert len(events) < 3000
    assert moved["kvfence_requests_total{outcome=finished}"] == 1
    assert moved["kvfence_requests_total{outcome=aborted}"] == 0


# ---- shared-prefix-cache (I8) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_cache(lab_checkpoint: Path) -> Iterator[Served]:
    with roomy_server(lab_checkpoint, FaultSet.of(Fault.SHARED_PREFIX_CACHE)) as s:
        yield s


def cached_tokens(s: Served, tenant: str, prompt: str) -> int:
    body = {"model": s.info()["model"], "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = s.post("/v1/completions", tenant, json=body)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"word{i}" for i in range(60))  # well over 4 full pages


@pytest.mark.parametrize(("first", "second"), [("a", "b"), ("b", "a")])
def test_shared_prefix_cache_lets_one_tenant_hit_another_s_prefix(
    production: Served, shared_cache: Served, first: str, second: str
) -> None:
    assert shared_cache.info()["lab"]["faults"] == ["shared-prefix-cache"]
    assert shared_cache.info()["prefix_cache"]["namespacing"] == "shared"
    assert production.info()["prefix_cache"]["namespacing"] == "tenant"
    for s, crosses in ((production, False), (shared_cache, True)):
        p = long_prompt(f"xt-{first}{second}-{crosses}")
        assert cached_tokens(s, first, p) == 0  # cold
        own = cached_tokens(s, first, p)
        assert own >= 64  # the same tenant hits, with or without the switch
        other = cached_tokens(s, second, p)
        if crosses:
            assert other == own  # CVE-2025-46570: the other tenant's prefix, observable
        else:
            assert other == 0  # I8: another tenant never hits it


# ---- no-invalidate (I5): below HTTP ----------------------------------------------------------


@pytest.fixture(scope="module")
def no_invalidate(lab_checkpoint: Path) -> Iterator[Served]:
    with roomy_server(lab_checkpoint, FaultSet.of(Fault.NO_INVALIDATE)) as s:
        yield s


def stale_read_after_reuse(s: Served) -> tuple[list[PageHandle], int]:
    """Tenant a's prompt is cached, evicted, and its pages re-granted to a's next prompt.

    Returns the handles the first prompt's cache entries held, and the cache
    namespace's owner id. Evicting and re-granting happen at quiescent points.
    """
    s.quiesce()
    model = s.info()["model"]
    body = {"model": model, "prompt": long_prompt("stale-1"), "max_tokens": 1}
    assert s.post("/v1/completions", "a", json=body).status_code == 200
    assert s.pipeline.wait_idle(timeout=60)
    cache = s.pipeline.prefill.cache
    stale = cache.handles()
    assert len(stale) >= 4
    s.pipeline.clear_prefix_cache()  # eviction releases the pages (I5 would invalidate here)
    body["prompt"] = long_prompt("stale-2")
    assert s.post("/v1/completions", "a", json=body).status_code == 200
    assert s.pipeline.wait_idle(timeout=60)
    fresh = {h.index for h in cache.handles()}
    assert {h.index for h in stale} <= fresh  # LIFO: the same physical pages, the same namespace
    return stale, stale[0].owner


def test_no_invalidate_keeps_a_released_handle_valid_for_the_next_grant(
    production: Served, no_invalidate: Served
) -> None:
    """Why not over HTTP: no client request can hold a page handle across a release —
    the router never hands one out — so a stale handle is only ever held inside the
    engine. The symptom is in the ledger of a real server's pipeline after real HTTP
    traffic: a handle from before the eviction still passes the I1 read check and
    reads the namespace's next prompt. The pure pool versions are in
    tests/engine/test_pool.py and test_pool_stateful.py."""
    assert no_invalidate.info()["lab"]["faults"] == ["no-invalidate"]
    for s, valid in ((production, False), (no_invalidate, True)):
        stale, owner = stale_read_after_reuse(s)
        pool = s.pipeline.prefill_pool
        ps = pool.page_size
        read = BatchPages.build([stale], [owner], [owner], [len(stale) * ps])
        if valid:
            pool.verify(read)  # the symptom: the stale grant is still accepted
            assert all(int(pool.generation[h.index]) == h.generation for h in stale)
        else:
            with pytest.raises(IsolationViolation, match="gen"):
                pool.verify(read)  # I5 bumped the generation on eviction
            assert all(int(pool.generation[h.index]) > h.generation for h in stale)
        s.quiesce()


# ---- early-free (I7): below HTTP -------------------------------------------------------------


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class Reuse:
    a_pages: set[int]  # A's reserved decode pages (its transfer may still land there)
    b_pages: set[int]  # B's reserved decode pages, granted after A's decode-side abort
    pending_when_b_came: int  # decode pages parked in PENDING_RELEASE at that moment


def reuse_after_decode_side_abort(checkpoint: Path, faults: FaultSet) -> Reuse:
    """A's request is reserved on decode and mid-prefill (16-token chunks) when decode alone
    learns of the abort (in PD mode the roles are separate processes). B's request comes
    next."""
    loaded = load_model(checkpoint, kind="mirror")
    config = EngineConfig(prefill_pages=32, decode_pages=32, chunk_size=16, max_batch_tokens=16)
    geometry = loaded.config.kv_geometry(page_size=config.page_size)
    pipe = LocalPipeline(loaded.model, geometry, config, faults, kv_link=inprocess_link)
    a_sink, b_sink = CollectingSink(), CollectingSink()
    pipe.submit(GenerateWork("ra", "tenant-a", tuple(range(300, 364)), greedy(4), "a"), a_sink)
    pipe.pump()  # bootstrap: decode reserves 4 pages, the window opens; prefill computes 16 tokens
    a_seq = pipe.decode.seqs["ra"]
    assert a_seq.req.state is RequestState.BOOTSTRAPPING and a_seq.reservation is not None
    a_pages = {h.index for h in a_seq.reservation.handles}
    pipe.decode.abort("ra", "client gone")  # prefill still owes the transfer
    # B's bootstrap is the first thing the next pump does, before the transport confirms
    # the cancelled room (I7): what is parked now is what is parked when B reserves.
    pending = pipe.decode_pool.num_pending
    pipe.submit(GenerateWork("rb", "tenant-b", tuple(range(100, 140)), greedy(4), "b"), b_sink)
    pipe.pump()
    b_seq = pipe.decode.seqs["rb"]
    assert b_seq.reservation is not None
    b_pages = {h.index for h in b_seq.reservation.handles}
    pipe.drive()
    b = b_sink.wait(0)
    assert b.error is None and b.token_ids == list(range(100, 104))  # B's own tokens
    return Reuse(a_pages, b_pages, pending)


def test_early_free_hands_pages_a_transfer_may_still_hit_to_another_tenant(
    lab_checkpoint: Path,
) -> None:
    """Why not over HTTP: in-process, the router's abort reaches prefill and decode in one
    engine step, so the window is closed before anyone can allocate; the gap exists when
    decode learns first (PD processes), driven here step by step on a real LocalPipeline.
    The in-process copy also refuses a closed window, so the late write itself is shown
    over real transports in tests/transfer/test_deferred_release.py."""
    off = reuse_after_decode_side_abort(lab_checkpoint, FaultSet())
    assert len(off.a_pages) == 4
    assert off.pending_when_b_came == 4  # I7: A's pages parked until the window closes...
    assert not off.a_pages & off.b_pages  # ...so B got others

    on = reuse_after_decode_side_abort(lab_checkpoint, FaultSet.of(Fault.EARLY_FREE))
    assert on.pending_when_b_came == 0  # nothing parked
    assert on.a_pages & on.b_pages  # the symptom: B holds pages A's transfer may still land in


def poisoned_beside_another(checkpoint: Path, faults: FaultSet) -> tuple[Result, Result]:
    """A's request seeded to be failed by `poisoned-sampling` from its second token on, B's
    greedy one beside it: both prefilled and decoded in the same steps."""
    loaded = load_model(checkpoint, kind="mirror")
    config = EngineConfig(prefill_pages=32, decode_pages=32)
    geometry = loaded.config.kv_geometry(page_size=config.page_size)
    pipe = LocalPipeline(loaded.model, geometry, config, faults, kv_link=inprocess_link)
    a_sink, b_sink = CollectingSink(), CollectingSink()
    marked = SamplingParams(max_tokens=4, seed=POISON_SEED + 1, ignore_eos=True)
    pipe.submit(GenerateWork("ra", "tenant-a", tuple(range(300, 332)), marked, "a"), a_sink)
    pipe.submit(GenerateWork("rb", "tenant-b", tuple(range(100, 132)), greedy(4), "b"), b_sink)
    pipe.drive()
    return a_sink.wait(0), b_sink.wait(0)


def test_poisoned_sampling_fails_the_marked_request_and_only_it(lab_checkpoint: Path) -> None:
    """The switch injects a failure (it removes no defence): off, the marked request is served;
    on, it fails with its own error while B, in the same steps, gets its own tokens."""
    a_off, b_off = poisoned_beside_another(lab_checkpoint, FaultSet())
    assert a_off.error is None and len(a_off.token_ids) == 4, a_off
    assert b_off.error is None and b_off.token_ids == list(range(100, 104))
    a_on, b_on = poisoned_beside_another(lab_checkpoint, FaultSet.of(Fault.POISONED_SAMPLING))
    assert a_on.error is not None and "poisoned-sampling" in a_on.error.message, a_on
    assert b_on.error is None and b_on.token_ids == list(range(100, 104)), b_on


def test_every_switch_has_a_test_here() -> None:
    tested = {U, ANT, DTB, NLC, Fault.ABORT_AS_SUCCESS, Fault.SHARED_PREFIX_CACHE}
    tested |= {Fault.NO_INVALIDATE, Fault.EARLY_FREE, Fault.POISONED_SAMPLING}
    assert tested == set(Fault)
