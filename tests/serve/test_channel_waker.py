"""A set `Waker` ends an inbox's wait at once; the room book sets it for every queued event."""

from __future__ import annotations

import threading
import time

import zmq

from kvfence.engine.messages import PageRef, TransferManifest
from kvfence.serve.channel import Inbox, Waker
from kvfence.transfer.rooms import RoomBook


def test_a_set_waker_ends_the_wait_and_is_cleared() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    inbox = Inbox(ctx, "inproc://waker-test", [TransferManifest])
    waker = Waker()
    inbox.wake_on(waker)
    try:
        threading.Timer(0.05, waker.set).start()
        start = time.monotonic()
        assert inbox.poll(60_000) == []  # nothing arrived: woken, not timed out
        assert time.monotonic() - start < 30
        waker.set()
        waker.set()  # several wake-ups coalesce into one
        assert inbox.poll(0) == []
        start = time.monotonic()
        assert inbox.poll(200) == []  # cleared: this one waits its timeout out
        assert time.monotonic() - start >= 0.15
    finally:
        inbox.close()
        waker.close()
        ctx.term()


def _manifest(room: str, refs: tuple[PageRef, ...]) -> TransferManifest:
    return TransferManifest(
        room=room,
        tenant="t",
        num_tokens=3,
        num_pages=1,
        dest_pages=refs,
        checksum="c",
        first_token=1,
    )


def test_the_book_notifies_on_every_event_a_transport_thread_queues() -> None:
    calls: list[int] = []
    book = RoomBook(page_size=4, on_event=lambda: calls.append(len(book.drain())))
    refs = (PageRef(0, 1),)
    book.expect("r1", refs)
    assert book.grant(_manifest("r1", refs)) is None
    book.landed(_manifest("r1", refs), "c")
    assert calls == [2]  # Landed + TransferDone, queued before the wake-up
    book.expect("r2", refs)
    assert book.grant(_manifest("r2", (PageRef(1, 1),))) is not None  # foreign pages: refused
    book.expect("r3", refs)
    assert book.grant(_manifest("r3", refs)) is None
    book.lost(["r3"])
    assert calls == [2, 2, 1]
