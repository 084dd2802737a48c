"""In-place writers' pages are checksummed by decode as they land, chunk by chunk (I3).

Shared memory, Mooncake and NIXL write decode's pool in chunks; after each but the last the
sender says how far it got (a P frame) and decode reads those bytes of its own
pages into the room's checksum while the next chunk is written; the end reads
the rest. Here the chunks are 1000 bytes, so runs are cut mid-page and the
check spans many P frames: an honest transfer must still reconcile to the
byte, and a byte the engine corrupts in transit must still be refused.
"""

from __future__ import annotations

import pytest
from decode_side import Decode, prefill
from test_transports import job, landed_bytes_equal_source
from transfer_children import GEOM, PROMPT

from kvfence.engine.reconcile import TransferMismatch
from kvfence.transfer.granted import chunked

pytestmark = pytest.mark.slow


def test_chunks_cut_runs_in_order_and_cover_every_byte() -> None:
    runs = [(0, 0, 100, 2500), (1, 40, 0, 700), (0, 9000, 5000, 10)]
    chunks = chunked(runs, 1000)
    assert [upto for _, upto in chunks] == [1000, 2000, 3000, 3210]
    flat = [r for group, _ in chunks for r in group]
    assert sum(n for *_, n in flat) == 3210
    assert flat[:3] == [(0, 0, 100, 1000), (0, 1000, 1100, 1000), (0, 2000, 2100, 500)]
    assert chunked(runs, 0) == [(runs, 3210)] and chunked([], 1000) == []


@pytest.mark.parametrize("transport", ["shm:1000", "mooncake:1000", "nixl:1000"])
def test_an_engine_transfer_is_checked_as_it_lands(transport: str) -> None:
    if not transport.startswith("shm"):
        pytest.importorskip("mooncake.engine" if transport.startswith("mooncake") else "nixl_cu12")
    decode = Decode(transport)
    try:
        good, bad = decode.reserve("good"), decode.reserve("flip")
        with prefill(decode, [job(good, seed=3), job(bad, seed=4, tamper="flip")]):
            decode.wait_done("good", "flip")
        with pytest.raises(TransferMismatch) as err:
            decode.accept("flip", bad)
        assert err.value.field == "checksum"
        # Both rooms span many chunks; all but the last of each were read before its end.
        # (NIXL's notification may end a room before its last P frames are read: then the
        # end reads those bytes; shared memory's and Mooncake's E frame follows their P frames.)
        per_room = -(-PROMPT * GEOM.bytes_per_token // 1000) - 1
        checked = decode.rx.chunks_checked  # type: ignore[attr-defined]
        assert checked == 2 * per_room if not transport.startswith("nixl") else checked > 0
        decode.accept("good", good)
        assert landed_bytes_equal_source(decode, good, seed=3)
    finally:
        decode.close()
