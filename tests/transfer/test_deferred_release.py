"""I7: pages whose transfer may still land are not reused until the transport confirms.

A prefill is granted a room, then held mid-transfer; decode aborts the request
and releases its pages; another owner allocates; then the late write lands.
With the defence the other owner never gets those pages; with the lab's
`early-free` switch it does, and the late write overwrites its KV.
"""

from __future__ import annotations

import pytest
import torch
from decode_side import CTX, Decode, prefill
from test_transports import job
from transfer_children import GEOM, PROMPT, Job, dying_tcp_sender, source_pool

from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import KVPool, PageHandle

IN_PLACE = [
    "inprocess",
    pytest.param("shm", marks=pytest.mark.slow),
    # Real engines that know no pages: a late write lands wherever the grant said.
    pytest.param("mooncake", marks=pytest.mark.slow),
    pytest.param("nixl", marks=pytest.mark.slow),
]
MARKER = 7.0  # the other owner's own KV


def page_kv(pool: KVPool, handles: list[PageHandle]) -> torch.Tensor:
    idx = [h.index for h in handles]
    return torch.stack([pool.k[:, idx], pool.v[:, idx]])


def write_own_kv(pool: KVPool, handles: list[PageHandle]) -> None:
    idx = torch.tensor([h.index for h in handles])
    pool.k[:, idx] = MARKER
    pool.v[:, idx] = MARKER


@pytest.mark.parametrize("transport", IN_PLACE)
@pytest.mark.parametrize("early_free", [False, True], ids=["deferred", "early-free"])
def test_abort_during_transfer(transport: str, early_free: bool) -> None:
    faults = FaultSet.of(Fault.EARLY_FREE) if early_free else FaultSet()
    decode = Decode(transport, faults)
    try:
        res = decode.reserve("victim")
        reserved = {h.index for h in res.handles}
        with prefill(decode, [job(res, seed=8, hold="pause")]) as conn:
            assert conn.recv() == ("granted", "victim")
            # The client disconnects: decode cancels and releases while the write is in flight.
            decode.rx.cancel("victim")
            decode.pool.release(res.handles)
            decode.reservations.clear()
            decode.poll()
            other = decode.pool.allocate(decode.pool.register_owner("other"), len(res.handles))
            write_own_kv(decode.pool, other)
            reused = reserved & {h.index for h in other}
            if early_free:
                assert reused == reserved  # LIFO hands the in-flight pages straight out
            else:
                assert not reused
                assert decode.pool.num_pending == len(reserved)
            conn.send("go")  # the late write lands now
            assert conn.recv()[0] == "sent"
            decode.wait_done("victim")
        assert decode.done("victim").ok is False  # type: ignore[union-attr]
        assert "victim" not in {
            e.manifest.room for e in decode.events["victim"] if hasattr(e, "manifest")
        }
        src, src_handles = source_pool(8)
        own = page_kv(decode.pool, other)
        if early_free:
            # Another owner's pages now hold the aborted request's KV, in table order.
            order = sorted(other, key=lambda h: [x.index for x in res.handles].index(h.index))
            assert torch.equal(
                page_kv(decode.pool, order)[:, :, :-1], page_kv(src, src_handles)[:, :, :-1]
            )
            assert not torch.all(own == MARKER)
        else:
            assert torch.all(own == MARKER)  # untouched
            assert decode.pool.num_pending == 0  # freed only after the confirmation
        decode.pool.release(other)
        decode.pool.check_integrity()
        assert decode.pool.num_free == decode.pool.num_pages
    finally:
        decode.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "mooncake", "nixl"])
def test_a_dead_in_place_sender_counts_as_cancelled(transport: str) -> None:
    """A prefill dying between the grant and the end of its writes (kill prefill mid-transfer)."""
    decode = Decode(transport)
    try:
        res = decode.reserve("orphan")
        with prefill(decode, [job(res, seed=2, hold="die")]) as conn:
            assert conn.recv() == ("granted", "orphan")
            decode.pool.release(res.handles)  # the request fails; its pages must wait
            decode.reservations.clear()
            decode.poll()
            assert decode.pool.num_pending == len(res.handles) or decode.done("orphan")
            decode.wait_done("orphan")  # the closed control socket is the confirmation
        assert decode.done("orphan").ok is False  # type: ignore[union-attr]
        assert all(not hasattr(e, "manifest") for e in decode.events["orphan"])
        assert decode.pool.num_pending == 0
        decode.pool.check_integrity()
        assert decode.pool.num_free == decode.pool.num_pages
    finally:
        decode.close()


@pytest.mark.slow
def test_a_tcp_sender_dying_mid_payload_ends_the_room_and_the_receiver_carries_on() -> None:
    decode = Decode("tcp")
    try:
        res = decode.reserve("half")
        parent, child = CTX.Pipe()
        proc = CTX.Process(
            target=dying_tcp_sender, args=(decode.rx.address, job(res, seed=4), child)
        )
        proc.start()
        assert parent.recv() == ("half-sent", "half")
        parent.send("die")
        proc.join(60)
        decode.wait_done("half")
        assert decode.done("half").ok is False  # type: ignore[union-attr]
        assert all(not hasattr(e, "manifest") for e in decode.events["half"])  # never "landed"
        good = decode.reserve("next")
        with prefill(decode, [job(good, seed=6)]):
            decode.wait_done("next")
        decode.accept("next", good)
        decode.release_all()
        decode.pool.check_integrity()
        assert decode.pool.num_free == decode.pool.num_pages
    finally:
        decode.close()


def test_cancel_before_any_grant_is_confirmed_at_once_and_a_late_sender_is_refused() -> None:
    decode = Decode("inprocess")
    try:
        res = decode.reserve("late")
        decode.rx.cancel("late")
        decode.pool.release(res.handles)
        decode.reservations.clear()
        decode.poll()
        assert decode.done("late") is not None and decode.pool.num_pending == 0
        with prefill(
            decode,
            [Job("late", "acme", PROMPT, tuple((r.index, r.generation) for r in res.refs), 1)],
        ) as conn:
            kind, why = conn.recv()
        assert kind == "refused" and "not expecting" in why
        decode.pool.check_integrity()
        assert GEOM.pages_for(PROMPT) == len(res.handles)
    finally:
        decode.close()
