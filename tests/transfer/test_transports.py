"""KV transfer across real processes (TCP, shared memory) and in-process, reconciled by decode (I3)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from decode_side import Decode, prefill
from transfer_children import GEOM, PROMPT, Job, source_pool

from kvfence.engine.reconcile import Reservation, TransferMismatch, payload_checksum
from kvfence.faults import Fault, FaultSet

TRANSPORTS = [
    "inprocess",
    pytest.param("tcp", marks=pytest.mark.slow),
    pytest.param("shm", marks=pytest.mark.slow),
    pytest.param("mooncake", marks=pytest.mark.slow),
    pytest.param("nixl", marks=pytest.mark.slow),
]


def job(res: Reservation, seed: int, **changes: Any) -> Job:
    """The prefill job that serves this reservation honestly, unless `changes` say otherwise."""
    honest = Job(
        room=res.room,
        tenant=res.tenant,
        num_tokens=res.num_tokens,
        dest=tuple((r.index, r.generation) for r in res.refs),
        seed=seed,
    )
    return dataclasses.replace(honest, **changes)


def assert_quiet_and_clean(decode: Decode) -> None:
    decode.release_all()
    decode.pool.check_integrity()
    assert decode.pool.num_free == decode.pool.num_pages, "a page leaked"


def landed_bytes_equal_source(decode: Decode, res: Reservation, seed: int) -> bool:
    src, handles = source_pool(seed)
    return payload_checksum(src, handles, res.num_tokens) == payload_checksum(
        decode.pool, res.handles, res.num_tokens
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_several_requests_land_and_reconcile(transport: str) -> None:
    decode = Decode(transport)
    try:
        rooms = [decode.reserve(f"room-{i}", tenant=f"t{i}") for i in range(3)]
        with prefill(decode, [job(res, seed=10 + i) for i, res in enumerate(rooms)]) as conn:
            decode.wait_done(*(r.room for r in rooms))
            assert [conn.recv()[0] for _ in rooms] == ["sent"] * 3
        for i, res in enumerate(rooms):
            assert decode.done(res.room) is not None and decode.done(res.room).ok  # type: ignore[union-attr]
            decode.accept(res.room, res)
            assert landed_bytes_equal_source(decode, res, seed=10 + i)
            written = decode.pool.written[[h.index for h in res.handles]].tolist()
            assert written == [4] * 7 + [2]  # 30 tokens in pages of 4: only written slots count
        assert decode.pool.num_pending == 0
        assert_quiet_and_clean(decode)
    finally:
        decode.close()


# What each in-transit fault must be refused as (the field reconcile names).
FAULTS = {
    "truncate": "checksum",
    "duplicate": "checksum",
    "reorder": "checksum",
    "flip": "checksum",
    "tenant": "tenant",
    "placeholder": "num_tokens",  # the incident: 1 token, 1 page, for an 8-page reservation
    "stale": "dest_pages[0]",
}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_transfer_fault_is_refused_and_the_receiver_keeps_working(transport: str) -> None:
    decode = Decode(transport)
    try:
        # Stale: the room's first reservation was released and the room re-reserved
        # (same pages, next generation); prefill still addresses the old handles.
        old = decode.reserve("stale")
        decode.rx.cancel("stale")
        decode.pool.release(old.handles)
        decode.poll()
        new = decode.reserve("stale")
        assert {h.index for h in new.handles} == {h.index for h in old.handles}
        jobs = [job(old, seed=99)]
        # In-place senders checksum while they copy, so a source byte flipped before
        # the copy is simply what was sent: in-process (decode reads its pages after the
        # end) gets memory corruption after landing; shared memory and the engines (decode
        # reads as the P/E frames say bytes landed) get a byte flipped after the sender's
        # checksum and before the frame that reports it written.
        flip_after_landing = transport == "inprocess"
        for i, fault in enumerate(f for f in FAULTS if f != "stale"):
            res = decode.reserve(fault)
            if fault == "placeholder":
                jobs.append(job(res, seed=i, num_tokens=1))
            elif fault == "flip" and flip_after_landing:
                jobs.append(job(res, seed=i))
            else:
                jobs.append(job(res, seed=i, tamper=fault))
        good = decode.reserve("good-after-faults")
        jobs.append(job(good, seed=42))
        with prefill(decode, jobs):
            decode.wait_done(*FAULTS, good.room)
        if flip_after_landing:
            page = decode.reservations["flip"].handles[1].index
            decode.pool.k.view(torch.uint8)[0, page].view(-1)[5] ^= 0x10
        for room, field in FAULTS.items():
            with pytest.raises(TransferMismatch) as err:
                decode.accept(room, decode.reservations[room])
            assert err.value.field == field, f"{room}: {err.value}"
            assert not decode.pool.written[
                [h.index for h in decode.reservations[room].handles]
            ].any()
        decode.accept(good.room, good)
        assert landed_bytes_equal_source(decode, good, seed=42)
        assert_quiet_and_clean(decode)
    finally:
        decode.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_with_reconciliation_bypassed_the_short_transfer_is_accepted(transport: str) -> None:
    """The lab's decode-trusts-bootstrap switch: the same 1-page transfer now passes (the bug)."""
    decode = Decode(transport, FaultSet.of(Fault.DECODE_TRUSTS_BOOTSTRAP))
    try:
        res = decode.reserve("short")
        with prefill(decode, [job(res, seed=5, num_tokens=1)]):
            decode.wait_done(res.room)
        decode.accept(res.room, res)  # no TransferMismatch: the leak's door
        written = decode.pool.written[[h.index for h in res.handles]].tolist()
        # Only what landed is marked written, so the I1 read check still stands alone.
        assert written == [1] + [0] * 7
        assert_quiet_and_clean(decode)
    finally:
        decode.close()


def test_a_reservation_released_and_reallocated_is_stale_in_the_ledger() -> None:
    """A manifest matching the handles decode kept is still refused once the ledger moved on."""
    decode = Decode("inprocess", FaultSet.of(Fault.EARLY_FREE))
    try:
        res = decode.reserve("r")
        with prefill(decode, [job(res, seed=3)]):
            decode.wait_done(res.room)
        decode.pool.release(res.handles)  # an engine bug: released before the accept
        other = decode.pool.allocate(decode.pool.register_owner("other"), GEOM.pages_for(PROMPT))
        assert {h.index for h in other} == {h.index for h in res.handles}
        with pytest.raises(TransferMismatch) as err:
            decode.accept("r", res)
        assert err.value.field.startswith("ledger page")
        decode.pool.release(other)
        decode.reservations.clear()
        decode.pool.check_integrity()
    finally:
        decode.close()


def test_source_pool_is_deterministic() -> None:
    a, ha = source_pool(1)
    b, hb = source_pool(1)
    assert torch.equal(a.k, b.k) and ha == hb
