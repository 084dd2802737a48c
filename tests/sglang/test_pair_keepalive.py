"""Decode's wait for a paired room follows prefill: while prefill says it holds the room
(`Queued`, at pairing and then every few seconds), a room waiting behind a long prefill
queue keeps its place; once prefill goes silent, the room fails one wait after its last
word with a 504 that says so.

A real decode side (tiny model, TCP receiver) and, as prefill, the test's own ZeroMQ
sockets speaking the wire protocol: the test decides when prefill speaks. A 2 s wait
(the real one is 30 s) keeps it short. Before the keep-alive, a room still queued at
prefill after the wait failed with a 504 under load (16 concurrent smollm prompts at load
15-20: 9 of 16 failed).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from sgl_helpers import decode_side, room_work

from kvfence.engine.messages import (
    Failure,
    Queued,
    RoomRegistration,
    TokenChunk,
    decode_message,
    encode_message,
)
from kvfence.model.loader import load_model
from kvfence.sglang_stack.decode import DecodeSide

WAIT_S = 2.0


@pytest.fixture
def decode(sgl_checkpoint: Path) -> Iterator[DecodeSide]:
    loaded = load_model(str(sgl_checkpoint), kind="mirror")
    side = decode_side(sgl_checkpoint, loaded, pair_timeout_s=WAIT_S)
    side.start()
    yield side
    side.stop()


def test_a_room_prefill_still_holds_waits_and_fails_once_prefill_goes_silent(
    decode: DecodeSide,
) -> None:
    ctx = zmq.Context()
    prefill_in = ctx.socket(zmq.PULL)
    prefill_in.setsockopt(zmq.LINGER, 0)
    port = prefill_in.bind_to_random_port("tcp://127.0.0.1")
    events: queue.Queue[TokenChunk | Failure] = queue.Queue()
    work = room_work(f"tcp://127.0.0.1:{port}")
    try:
        decode.submit(work, events.put)
        assert prefill_in.poll(30_000), "decode never registered the room with prefill"
        reg = decode_message(prefill_in.recv())
        assert isinstance(reg, RoomRegistration) and reg.room == "room-1", reg
        to_decode = ctx.socket(zmq.PUSH)
        to_decode.setsockopt(zmq.LINGER, 0)
        to_decode.connect(reg.reply_addr)
        # Prefill holds the room (it is queued there) for 3 waits, saying so twice a wait.
        end = time.monotonic() + 3 * WAIT_S
        while time.monotonic() < end:
            to_decode.send(encode_message(Queued("room-1")))
            time.sleep(WAIT_S / 4)
            assert events.empty(), events.get_nowait()
        # Then silence: the room fails within about one wait, with a message that says so.
        silent = time.monotonic()
        event = events.get(timeout=10 * WAIT_S)
        waited = time.monotonic() - silent
        assert isinstance(event, Failure), event
        assert event.error.status == 504 and event.error.code == "pair_timeout", event
        assert "said nothing of it" in event.error.message, event.error.message
        assert WAIT_S * 0.5 <= waited <= WAIT_S * 5, waited
    finally:
        ctx.destroy(linger=0)  # every socket the test opened, whatever failed
