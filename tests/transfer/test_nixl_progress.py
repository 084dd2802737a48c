"""NIXL's agents make progress without a thread that spins.

NIXL's own progress thread polls UCX with no pause: it held a core in every worker, and the
stack over NIXL ran at half of TCP's pace on 2 cores. The agents run without it
(`transfer/nixl.py`), and the transfer tests show decode's receiver still drives its side
(with its pump off they all time out). This one holds the cost down: a connected pair that
moves nothing spends next to no CPU (1.0 core with NIXL's thread, 0.015 without).
"""

from __future__ import annotations

import time

import pytest
from decode_side import Decode
from transfer_children import make_transport

pytestmark = pytest.mark.slow
IDLE_S = 3.0


def test_a_connected_nixl_pair_moving_nothing_spends_next_to_no_cpu() -> None:
    pytest.importorskip("nixl_cu12")
    decode = Decode("nixl")
    sender = make_transport("nixl").sender(decode.rx.address)  # its agent in this process too
    try:
        time.sleep(0.5)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(IDLE_S)
        cores = (time.process_time() - cpu) / (time.monotonic() - wall)
        # Process CPU time counts this process's threads only: other load cannot raise it.
        assert cores < 0.25, f"an idle NIXL sender and receiver spent {cores:.2f} cores"
    finally:
        sender.close()
        decode.close()
