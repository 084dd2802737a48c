"""Prefill-side helpers for the transfer tests: run in a child process (or a thread for in-process).

Jobs describe what the sender is asked to do, including wire faults applied
to the prepared `Outgoing` between `prepare` and `transmit` (what corruption,
loss or reordering in transit would do to the bytes that land).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from kvfence.engine.messages import PageRef, encode_message
from kvfence.engine.prefill import OutboundTransfer
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool, PageHandle
from kvfence.transfer import framing
from kvfence.transfer.base import InPlaceSender, KVSender, KVTransport, TransferRefused
from kvfence.transfer.granted import GrantedSender
from kvfence.transfer.layout import Outgoing, PoolShape
from kvfence.transfer.registry import get_transport
from kvfence.transfer.shm import ShmSender

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
PROMPT = 30  # tokens: 8 pages of 4, the last one partly filled


@dataclass(frozen=True)
class Job:
    room: str
    tenant: str
    num_tokens: int
    dest: tuple[tuple[int, int], ...]
    seed: int
    tamper: str = ""  # truncate | duplicate | reorder | flip | tenant | die-mid-payload
    hold: str = ""  # "pause": wait for the parent after the grant; "die": exit after the grant


def source_pool(seed: int) -> tuple[KVPool, list[PageHandle]]:
    """Prefill's pool with the request's KV (deterministic per seed)."""
    pool = KVPool(GEOM, 16)
    gen = torch.Generator().manual_seed(seed)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    return pool, pool.allocate(pool.register_owner("prefill"), GEOM.pages_for(PROMPT))


def tamper(out: Outgoing, how: str) -> Outgoing:
    p = out.positions
    if how == "truncate":  # only the first page goes out; the manifest still claims all 8
        keep = p == 0
        for name in ("kinds", "src_offsets", "dst_offsets", "lengths", "positions"):
            setattr(out, name, getattr(out, name)[keep])
    elif how == "duplicate":  # page 1's bytes land in page 2's slot too
        out.src_offsets[p == 2] = out.src_offsets[p == 1]
    elif how == "reorder":  # pages 1 and 2 swapped in transit
        one, two = out.src_offsets[p == 1].copy(), out.src_offsets[p == 2].copy()
        out.src_offsets[p == 1], out.src_offsets[p == 2] = two, one
    elif how == "flip":  # one bit of one byte of page 1 flipped after the checksum was taken
        k = out.src_pool.k.view(torch.uint8).reshape(-1)
        k[int(out.src_offsets[p == 1][0])] ^= 0x10
    elif how == "tenant":
        out.manifest = dataclasses.replace(out.manifest, tenant="mallory")
    elif how:
        raise ValueError(f"unknown tamper {how!r}")
    return out


def outbound(job: Job, handles: list[PageHandle]) -> OutboundTransfer:
    """What prefill hands the transport for this job (first token 7)."""
    dest = tuple(PageRef(i, g) for i, g in job.dest)
    return OutboundTransfer(job.room, job.tenant, job.num_tokens, dest, tuple(handles), 7, (), 0)


def flip_in_flight(sender: GrantedSender, out: Outgoing) -> None:
    """A transfer engine corrupts a byte of page 1 in transit (after the sender's checksum)."""
    real = sender.write

    def write(o: Outgoing, end: Callable[[], bytes]) -> str | None:
        body = end()  # the source checksum, taken before the flip
        tamper(o, "flip")
        try:
            return real(o, lambda: body)
        finally:
            tamper(o, "flip")  # flipped back: the next job's source is clean
            del sender.write  # type: ignore[method-assign]

    sender.write = write  # type: ignore[method-assign]


def flip_before_reported(sender: ShmSender, out: Outgoing) -> None:
    """Decode's memory corrupted in place between the sender's copy (and its checksum) and
    decode's read: a byte of page 1 flipped just before the first P or E frame, which
    reports it written (page 1 lies inside any chunk of 512 bytes or more)."""
    row = (out.positions == 1) & (out.kinds == 0)
    offset = int(out.dst_offsets[row][0])
    real = {"send_progress": sender.send_progress, "send_end": sender.send_end}

    def flip_then(name: str) -> Callable[..., None]:
        def report(*args: Any) -> None:
            sender.dest[0][offset] ^= 0x10
            for attr in real:  # once: the later reports go straight through
                delattr(sender, attr)
            real[name](*args)

        return report

    for name in real:
        setattr(sender, name, flip_then(name))


def run_job(sender: KVSender, job: Job, conn: Connection) -> tuple[str, str]:
    pool, handles = source_pool(job.seed)
    if job.tamper == "flip" and isinstance(sender, GrantedSender):
        out = sender.prepare(outbound(job, handles), pool)
        flip_in_flight(sender, out)
    elif job.tamper == "flip" and isinstance(sender, ShmSender):
        out = sender.prepare(outbound(job, handles), pool)
        flip_before_reported(sender, out)
    else:
        out = tamper(sender.prepare(outbound(job, handles), pool), job.tamper)
    try:
        if job.hold:
            assert isinstance(sender, InPlaceSender)
            sender.begin(out)
            conn.send(("granted", job.room))
            if job.hold == "die":
                os._exit(3)  # a prefill node dying between the grant and the end of its writes
            conn.recv()
            sender.complete(out)
        else:
            sender.transmit(out)
    except TransferRefused as e:
        return ("refused", str(e))
    return ("sent", out.manifest.checksum)


def run_jobs(sender: KVSender, jobs: list[Job], conn: Connection) -> None:
    for job in jobs:
        conn.send(run_job(sender, job, conn))


def make_transport(name: str) -> KVTransport:
    """A backend by name; `mooncake:1000` is Mooncake writing (and announcing) 1000-byte
    chunks (`shm:1000`, `nixl:1000` alike)."""
    base, _, chunk = name.partition(":")
    return get_transport(base, chunk_bytes=int(chunk)) if chunk else get_transport(base)


def sender_process(transport: str, address: str, jobs: list[Job], conn: Connection) -> None:
    """A prefill process: connect to decode at `address` and run the jobs in order."""
    sender = make_transport(transport).sender(address)
    run_jobs(sender, jobs, conn)
    sender.close()
    conn.send(("closed", ""))


def dying_tcp_sender(address: str, job: Job, conn: Connection) -> None:
    """Send a TCP frame header and half the payload, then die (a prefill crash mid-transfer)."""
    host, port = framing.parse_address(address, "tcp")
    sock = socket.create_connection((host, port))
    _, body, _ = framing.recv_frame(sock)
    shape = PoolShape.from_json(json.loads(body))
    pool, handles = source_pool(job.seed)
    out = KVSenderShim(shape).prepare(outbound(job, handles), pool)
    framing.send_frame(sock, framing.DATA, encode_message(out.manifest), out.payload_bytes)
    half = np.frombuffer(pool.k.view(torch.uint8).reshape(-1).numpy().data, np.uint8)
    sock.sendall(half[: out.payload_bytes // 2].tobytes())
    conn.send(("half-sent", job.room))
    conn.recv()
    os._exit(3)


class KVSenderShim(KVSender):
    """Only `prepare`: lays out a transfer for a receiver of a known shape."""

    def __init__(self, shape: PoolShape) -> None:
        self._shape = shape

    @property
    def dest_shape(self) -> PoolShape:
        return self._shape

    def transmit(self, out: Outgoing) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None
