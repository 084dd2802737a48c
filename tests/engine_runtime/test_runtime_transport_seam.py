"""The embedded default (`kvfence serve`, one process) runs the KV transport contract.

Its KV goes through `transfer`'s in-process transport, the two roles'
KV halves in one process: the receiver grants a room before any write, decode
reconciles the manifest (I3), and released pages wait until the transport
confirms (I7). The `decode-trusts-bootstrap` and `early-free` switches break
it here exactly as they do over TCP and shared memory
(tests/transfer/test_transports.py, tests/transfer/test_deferred_release.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from runtime_helpers import PAGE, Models, assert_quiet_and_empty, greedy, run, work

from kvfence.engine.config import EngineConfig
from kvfence.engine.prefill import OutboundTransfer
from kvfence.engine.request import RequestState
from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import KVPool
from kvfence.serve.pipeline import CollectingSink, LocalPipeline
from kvfence.transfer.base import InPlaceSender
from kvfence.transfer.inprocess import InProcessReceiver
from kvfence.transfer.link import TransportLink, inprocess_link

MARKER = 7.0  # another owner's own KV


class ShortLink(TransportLink):
    """Sends one page of a longer prompt and calls it done (the #30233 transfer)."""

    def send(self, transfer: OutboundTransfer, src: KVPool) -> bool:
        forged = replace(transfer, src_pages=transfer.src_pages[:1], num_tokens=PAGE)
        return super().send(forged, src)


class HeldLink(TransportLink):
    """Runs `between(room)` after the receiver granted the room, before the pages are written."""

    between: Callable[[str], None] = staticmethod(lambda room: None)

    def send(self, transfer: OutboundTransfer, src: KVPool) -> bool:
        assert isinstance(self.sender, InPlaceSender)
        out = self.sender.prepare(transfer, src)
        self.sender.begin(out)  # the grant: from here the write may land at any time
        self.between(transfer.room)
        self.sender.complete(out)  # the late write
        return True


def pipeline(
    models: Models, link: type[TransportLink], faults: FaultSet | None = None, **config: object
) -> LocalPipeline:
    def make(pool: KVPool) -> TransportLink:
        honest = inprocess_link(pool)
        return link(honest.receiver, honest.sender)

    engine = replace(EngineConfig(prefill_pages=64, decode_pages=128, page_size=PAGE), **config)  # type: ignore[arg-type]
    geometry = models.config.kv_geometry(page_size=PAGE)
    return LocalPipeline(models.mirror, geometry, engine, faults, kv_link=make)


def test_the_embedded_default_is_the_in_process_transport(models: Models) -> None:
    pipe = models.pipeline()
    assert isinstance(pipe.kv_link, TransportLink)
    assert isinstance(pipe.kv_link.receiver, InProcessReceiver)
    prompts = [list(range(10 + i, 60 + 7 * i)) for i in range(4)]
    results = run(pipe, [work(f"r{i}", f"t{i}", p, greedy(12)) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results, strict=True):
        assert r.error is None and r.token_ids == p[:12]
    pipe.abort("gone", "never existed")
    pipe.drive()
    assert_quiet_and_empty(pipe)


@pytest.mark.parametrize("trusts", [False, True], ids=["reconciled", "decode-trusts-bootstrap"])
def test_a_short_transfer_is_refused_unless_decode_trusts_the_bootstrap(
    models: Models, trusts: bool
) -> None:
    """As over TCP and shm: reconcile refuses the 1-page transfer for a 4-page reservation;
    with the switch it is accepted and only the I1 read check is left to stop the row."""
    faults = FaultSet.of(Fault.DECODE_TRUSTS_BOOTSTRAP) if trusts else FaultSet()
    pipe = pipeline(models, ShortLink, faults)
    (r,) = run(pipe, [work("r", "t", list(range(10, 74)), greedy(12))])
    assert r.error is not None
    # Trusted, the row starts: its first token (prefilled from its own prompt) may stream.
    assert r.token_ids == ([10] if trusts else [])
    if trusts:
        assert r.error.status == 500 and pipe.stats().counters.transfer_mismatches == 0
        assert pipe.stats().counters.isolation_violations == 1
    else:
        assert r.error.status == 502 and "num_tokens" in r.error.message
        assert pipe.stats().counters.transfer_mismatches == 1
    assert_quiet_and_empty(pipe)


def test_a_transfer_after_decode_gave_up_is_refused_before_it_writes(models: Models) -> None:
    """Decode cancels before the grant (it alone learned of the abort): the room ends at once,
    and the late sender is refused by the receiver, not by the sender's own judgement."""
    pipe = pipeline(models, TransportLink, chunk_size=16, max_batch_tokens=16)
    sink = CollectingSink()
    pipe.submit(work("ra", "tenant-a", list(range(300, 364)), greedy(4)), sink)
    pipe.pump()  # reserved on decode; prefill has computed its first 16-token chunk
    assert pipe.decode.seqs["ra"].req.state is RequestState.BOOTSTRAPPING
    pipe.decode.abort("ra", "client gone")
    pipe.drive()
    assert pipe.stats().counters.transfer_failures == 1  # refused at the grant
    assert not pipe.decode_pool.written.any()  # nothing landed anywhere
    assert_quiet_and_empty(pipe)


@pytest.mark.parametrize("early_free", [False, True], ids=["deferred", "early-free"])
def test_pages_granted_to_a_transfer_wait_for_it_unless_early_free(
    models: Models, early_free: bool
) -> None:
    """I7, as over shm: decode aborts while a granted write is in flight and another owner
    allocates. Deferred: the pages stay parked and the late write hits nobody. `early-free`:
    the other owner gets the very pages, and the late write overwrites its KV."""
    faults = FaultSet.of(Fault.EARLY_FREE) if early_free else FaultSet()
    pipe = pipeline(models, HeldLink, faults, decode_pages=32)
    pool = pipe.decode_pool
    seen: dict[str, object] = {}

    def between(room: str) -> None:
        reserved = {h.index for h in pipe.decode.seqs[room].pages}
        pipe.decode.abort(room, "client gone")  # decode learns first (PD: another process)
        other = pool.allocate(pool.register_owner("other"), len(reserved))
        idx = torch.tensor([h.index for h in other])
        pool.k[:, idx] = MARKER
        pool.v[:, idx] = MARKER
        seen.update(reserved=reserved, other=other, pending=pool.num_pending)

    assert isinstance(pipe.kv_link, HeldLink)
    pipe.kv_link.between = between
    pipe.submit(work("victim", "tenant-a", list(range(300, 364)), greedy(4)), CollectingSink())
    pipe.drive()
    reserved, other = seen["reserved"], seen["other"]
    assert isinstance(reserved, set) and isinstance(other, list) and len(reserved) == 4
    reused = reserved & {h.index for h in other}
    idx = torch.tensor([h.index for h in other])
    own_kv_intact = bool(torch.all(pool.k[:, idx] == MARKER))
    if early_free:
        assert reused == reserved and seen["pending"] == 0
        assert not own_kv_intact  # the aborted request's KV is in another owner's pages
    else:
        assert not reused and seen["pending"] == 4
        assert own_kv_intact
        assert pool.num_pending == 0  # freed once the transport confirmed
    pool.release(other)
    assert_quiet_and_empty(pipe)
