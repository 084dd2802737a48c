"""A decode side taking turns on the cores sends a landed room's first token without its turn.

What lands carries prefill's first token. Decode then has a row to step, and in a stack that
takes turns it waits for the cores while another worker's step holds them; the first token
must not wait with it (a prefill chunk is hundreds of milliseconds). Both sides are real (the
mirror model, TCP KV transport, the bootstrap channel over loopback); the test itself holds
the cores through its own slot of decode's board, as a third worker stepping would.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
from sgl_helpers import room_work, side_pair

from kvfence.engine.messages import Failure, TokenChunk
from kvfence.sglang_stack import cores
from kvfence.sglang_stack.cores import CoreShare, CoreShareSpec
from kvfence.sglang_stack.decode import DecodeSide
from kvfence.sglang_stack.prefill import PrefillSide


@pytest.fixture
def pair(sgl_checkpoint: Path) -> Iterator[tuple[PrefillSide, DecodeSide]]:
    with side_pair(sgl_checkpoint) as sides:
        yield sides


def test_the_first_token_goes_out_while_another_worker_holds_the_cores(
    pair: tuple[PrefillSide, DecodeSide], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cores, "STUCK_S", 60.0)  # decode waits for the test's turn to end
    prefill, decode = pair
    board = tmp_path / "cores"
    CoreShareSpec.create(board, 2)
    decode.core_share = CoreShare(CoreShareSpec(str(board), 0, 2, 2), lambda n: None)
    other = CoreShare(CoreShareSpec(str(board), 1, 2, 2), lambda n: None)
    work = room_work(prefill.inbox.addr)
    at_decode: queue.Queue[TokenChunk | Failure] = queue.Queue()
    with other.turn(True):  # another worker's step holds the cores from here on
        prefill.submit(work, lambda event: None)
        decode.submit(work, at_decode.put)
        first = at_decode.get(timeout=30)
        assert isinstance(first, TokenChunk) and first.token_ids == (20,), first
        assert first.finish_reason is None
        assert at_decode.empty()  # the rest waits for decode's turn on the cores
    tokens = list(first.token_ids)
    while True:
        event = at_decode.get(timeout=30)
        assert isinstance(event, TokenChunk), event
        tokens += event.token_ids
        if event.finish_reason is not None:
            break
    assert tokens == list(range(20, 24)), tokens  # the mirror model echoes the prompt
