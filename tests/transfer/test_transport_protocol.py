"""The wire: malformed or unexpected frames are refused without hurting the receiver; the registry."""

from __future__ import annotations

import json
import socket

import pytest
from decode_side import Decode, prefill
from test_transports import job

from kvfence.engine.messages import Abort, PageRef, TransferManifest, encode_message
from kvfence.engine.reconcile import TransferMismatch
from kvfence.kv.pool import IsolationViolation
from kvfence.transfer import framing
from kvfence.transfer.base import KVTransport
from kvfence.transfer.inprocess import InProcessTransport
from kvfence.transfer.registry import (
    TransportRegistry,
    builtin_registry,
    get_transport,
    transport_names,
)


def raw_tcp(address: str) -> socket.socket:
    sock = socket.create_connection(framing.parse_address(address, "tcp"))
    kind, body, _ = framing.recv_frame(sock)
    assert kind == framing.HELLO and json.loads(body)["num_pages"] == 64
    return sock


def test_tcp_receiver_survives_garbage_and_refuses_an_unknown_room() -> None:
    decode = Decode("tcp")
    try:
        res = decode.reserve("real")
        sock = raw_tcp(decode.rx.address)
        framing.send_frame(sock, framing.DATA, b"{not json", 5)
        sock.sendall(b"12345")
        framing.send_frame(sock, framing.DATA, encode_message(Abort("real", "x")), 0)
        framing.send_frame(sock, b"Z", b"", 3)
        sock.sendall(b"abc")
        # A well-formed manifest for a room nobody reserved: drained, reported, refused.
        honest = job(res, seed=1)
        framing.send_frame(
            sock,
            framing.DATA,
            encode_message(_manifest_for(decode, res.room.replace("real", "ghost"), honest.dest)),
            decode.pool.geometry.bytes_per_token,
        )
        sock.sendall(bytes(decode.pool.geometry.bytes_per_token))
        sock.close()
        with prefill(decode, [honest]):
            decode.wait_done("real")
        decode.accept("real", res)  # the receiver kept working
        ghost = decode.landed("ghost")
        assert ghost.checksum is not None and ghost.checksum.startswith("refused: room 'ghost'")
        with pytest.raises(TransferMismatch, match="room"):
            decode.accept("ghost", res)
        decode.release_all()
        decode.pool.check_integrity()
    finally:
        decode.close()


def _manifest_for(decode: Decode, room: str, dest: tuple[tuple[int, int], ...]) -> TransferManifest:
    return TransferManifest(
        room=room,
        tenant="acme",
        num_tokens=1,
        num_pages=1,
        dest_pages=tuple(PageRef(i, g) for i, g in dest),
        checksum="xxh3-64:0",
        first_token=0,
    )


def test_registry_names_and_plug_in() -> None:
    assert transport_names() == ["inprocess", "mooncake", "nixl", "shm", "tcp"]
    assert isinstance(get_transport("inprocess"), InProcessTransport)
    with pytest.raises(ValueError, match="known: inprocess, mooncake, nixl, shm, tcp"):
        get_transport("gpu-rdma")
    registry = builtin_registry()
    registry.register_transport("gpu-rdma", InProcessTransport)  # a stand-in for a new backend
    transport: KVTransport = registry.get_transport("gpu-rdma")
    assert isinstance(transport, InProcessTransport)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_transport("tcp", InProcessTransport)
    assert "gpu-rdma" not in transport_names()  # registries are values, not global state
    assert TransportRegistry().names() == []


def test_expect_refuses_a_duplicate_room_and_stale_handles_without_side_effects() -> None:
    decode = Decode("inprocess")
    try:
        res = decode.reserve("dup")
        with pytest.raises(ValueError, match="already expecting"):
            decode.rx.expect(res)
        assert bool(decode.pool.inbound[[h.index for h in res.handles]].all())  # still protected
        decode.rx.cancel("dup")
        decode.pool.release(res.handles)
        decode.reservations.clear()
        decode.poll()
        with pytest.raises(IsolationViolation):
            decode.rx.expect(res)  # released: its handles are stale now
        assert decode.rx.waiting() == []
        decode.pool.check_integrity()
    finally:
        decode.close()


def test_the_declared_cross_process_names_are_the_registry_less_inprocess() -> None:
    # serve/specs.py declares them torch-free for the CLI; the registry is the truth.
    from kvfence.serve.specs import CROSS_PROCESS

    assert set(CROSS_PROCESS) == set(transport_names()) - {InProcessTransport.name}
