"""The lab switch that lets a decode worker take a client's room, without a process (fast)."""

from __future__ import annotations

from kvfence.faults import Fault, FaultSet
from kvfence.sglang_stack.routing import trusts_client_room

ROOM = {"prompt": "hi", "bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 5}
TRUSTING = FaultSet.of(Fault.DECODE_TRUSTS_BOOTSTRAP)


def test_only_the_lab_switch_makes_decode_take_a_clients_room() -> None:
    assert trusts_client_room(ROOM, "decode", TRUSTING)
    # Hardened (every other switch on, too): a client's room is never the router's.
    others = FaultSet.of(*(f for f in Fault if f is not Fault.DECODE_TRUSTS_BOOTSTRAP))
    assert not trusts_client_room(ROOM, "decode", FaultSet())
    assert not trusts_client_room(ROOM, "decode", others)
    # Decode's defect only; a body without the fields stays a direct request (refused).
    assert not trusts_client_room(ROOM, "prefill", TRUSTING)
    assert not trusts_client_room({"prompt": "hi"}, "decode", TRUSTING)
    assert not trusts_client_room(["bootstrap_room"], "decode", TRUSTING)
