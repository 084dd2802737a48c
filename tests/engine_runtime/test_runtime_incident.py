"""The Workers AI leak, reproduced inside the engine, and each defence that stops it.

Tenant A sends a prompt full of sentinel tokens; then tenant B sends a prompt
longer than the prefill pool. With every defence off (abort-not-terminal +
decode-trusts-bootstrap + no-ledger-check) the mirror model echoes A's
tokens to B with a normal finish. Turning any one defence back on turns the
leak into a clean error, and with the default fault set B gets the original
400 with nothing left allocated.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from runtime_helpers import Models, assert_quiet_and_empty, greedy, run, submit, work

from kvfence.engine.prefill import OutboundTransfer
from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import KVPool
from kvfence.serve.pipeline import LocalPipeline
from kvfence.transfer.link import TransportLink

SENTINEL = list(range(300, 360))  # tenant A's 60 tokens: fits the 64-token prefill pool
OVERLONG = list(range(100, 200))  # tenant B's 100 tokens: over the prefill pool
INCIDENT = (Fault.ABORT_NOT_TERMINAL, Fault.DECODE_TRUSTS_BOOTSTRAP, Fault.NO_LEDGER_CHECK)


def incident_pipeline(models: Models, faults: FaultSet) -> LocalPipeline:
    return models.pipeline(prefill_pages=4, decode_pages=32, faults=faults)


def run_scenario(models: Models, faults: FaultSet) -> tuple[LocalPipeline, list[int], object]:
    pipe = incident_pipeline(models, faults)
    (a,) = run(pipe, [work("a", "tenant-a", SENTINEL, greedy(8))])
    assert a.error is None and a.token_ids == SENTINEL[:8]
    (b,) = run(pipe, [work("b", "tenant-b", OVERLONG, greedy(40))])
    leaked = [t for t in b.token_ids if t in set(SENTINEL)]
    return pipe, leaked, b


def test_incident_profile_leaks_another_tenants_tokens(models: Models) -> None:
    pipe, leaked, b = run_scenario(models, FaultSet.of(*INCIDENT))
    assert b.error is None and b.finish_reason == "length"  # "HTTP 200"
    assert len(b.token_ids) == 40
    assert len(leaked) >= 8  # A's sentinel tokens, verbatim, in B's answer
    # The rest of the system saw nothing wrong: that is the bug.
    stats = pipe.stats().counters
    assert stats.isolation_violations == stats.transfer_mismatches == stats.failed == 0


def test_default_faultset_rejects_with_the_original_error_and_allocates_nothing(
    models: Models,
) -> None:
    pipe, leaked, b = run_scenario(models, FaultSet())
    assert leaked == [] and b.token_ids == []
    assert b.error is not None and b.error.status == 400
    assert "prompt has 100 tokens; this prefill pool holds at most 64 tokens" in b.error.message
    assert pipe.stats().counters.rejected == 1
    assert pipe.prefill.counters.computed_tokens == len(SENTINEL)  # B was never computed
    assert_quiet_and_empty(pipe)


@pytest.mark.parametrize(
    ("defence_on", "status", "counter"),
    [
        (Fault.ABORT_NOT_TERMINAL, 400, "rejected"),
        (Fault.DECODE_TRUSTS_BOOTSTRAP, 502, "transfer_mismatches"),
        (Fault.NO_LEDGER_CHECK, 500, "isolation_violations"),
    ],
)
def test_any_single_defence_turns_the_leak_into_a_clean_error(
    models: Models, defence_on: Fault, status: int, counter: str
) -> None:
    faults = FaultSet.of(*(f for f in INCIDENT if f is not defence_on))
    pipe, leaked, b = run_scenario(models, faults)
    # With only the ledger check left, B's first token (prefilled from its own
    # placeholder) may stream before the first decode step fails loudly.
    assert leaked == [] and set(b.token_ids) <= set(OVERLONG[:1])
    assert b.error is not None and b.error.status == status
    assert getattr(pipe.stats().counters, counter) == 1
    assert_quiet_and_empty(pipe)


class ShortLink(TransportLink):
    """A transport that sends one page and calls it done (the #30233 transfer)."""

    def send(self, transfer: OutboundTransfer, src: KVPool) -> bool:
        forged = replace(transfer, src_pages=transfer.src_pages[:1], num_tokens=16)
        return super().send(forged, src)


def forged_run(models: Models, faults: FaultSet) -> tuple[LocalPipeline, object, list[int]]:
    pipe = models.pipeline(faults=faults)
    honest = pipe.kv_link
    assert isinstance(honest, TransportLink)
    (a,) = run(pipe, [work("a", "tenant-a", SENTINEL, greedy(4))])
    pipe.kv_out.link = ShortLink(honest.receiver, honest.sender)  # the wire turns bad
    (b,) = run(pipe, [work("b", "tenant-b", list(range(100, 164)), greedy(30))])
    pipe.kv_out.link = honest
    assert a.error is None
    return pipe, b, [t for t in b.token_ids if t in set(SENTINEL)]


def test_forged_short_manifest_is_refused(models: Models) -> None:
    pipe, b, leaked = forged_run(models, FaultSet())
    assert b.error is not None and b.error.status == 502  # type: ignore[attr-defined]
    assert "num_tokens" in b.error.message  # type: ignore[attr-defined]
    assert b.token_ids == [] and leaked == []  # type: ignore[attr-defined]
    assert pipe.stats().counters.transfer_mismatches == 1
    assert_quiet_and_empty(pipe)


def test_forged_short_manifest_is_accepted_when_decode_trusts_bootstrap(models: Models) -> None:
    # The same test with reconciliation and the ledger check off: the row decodes
    # over pages it never received, and A's tokens come out (the test can fail).
    _, b, leaked = forged_run(
        models, FaultSet.of(Fault.DECODE_TRUSTS_BOOTSTRAP, Fault.NO_LEDGER_CHECK)
    )
    assert b.error is None and len(b.token_ids) == 30  # type: ignore[attr-defined]
    assert len(leaked) >= 8


def test_decode_trusting_bootstrap_alone_is_stopped_by_the_ledger(models: Models) -> None:
    pipe, b, leaked = forged_run(models, FaultSet.of(Fault.DECODE_TRUSTS_BOOTSTRAP))
    assert b.error is not None and b.error.status == 500  # type: ignore[attr-defined]
    assert leaked == []
    assert pipe.stats().counters.isolation_violations == 1
    assert_quiet_and_empty(pipe)


def test_a_violation_fails_only_the_offending_row(models: Models) -> None:
    pipe = models.pipeline()
    good_prompt, bad_prompt = list(range(10, 40)), list(range(50, 80))
    good, bad = submit(
        pipe,
        [work("good", "t1", good_prompt, greedy(20)), work("bad", "t2", bad_prompt, greedy(20))],
    )
    for _ in range(4):
        pipe.pump()
    victim = pipe.decode.seqs["bad"]
    page = victim.pages[0].index
    pipe.decode_pool.generation[page] += 1  # its handle is stale now: reads must fail (I1)
    pipe.drive()
    assert good.wait(0).token_ids == good_prompt[:20]
    err = bad.wait(0).error
    assert err is not None and err.status == 500 and "isolation violation" in err.message
    assert pipe.stats().counters.isolation_violations == 1
    pipe.check_integrity()
