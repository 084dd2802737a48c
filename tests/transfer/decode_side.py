"""Decode-side harness for the transfer tests: a real pool and receiver, and a prefill to feed it."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

from transfer_children import GEOM, PROMPT, Job, make_transport, run_jobs, sender_process

from kvfence.engine.messages import TransferDone
from kvfence.engine.reconcile import Reservation, payload_checksum, reconcile
from kvfence.faults import FaultSet
from kvfence.kv.pool import KVPool
from kvfence.transfer.rooms import Event, Landed

# Senders run in their own processes, forked from a server that imported torch and the sender
# code once (the preload): each child starts in milliseconds instead of re-importing torch
# (seconds each, far more under load). The server forks before any torch op has started a
# thread, so every child is as clean as a spawned one.
CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["transfer_children"])
DEADLINE_S = 60.0  # a hang guard, not a timing assertion


class Decode:
    def __init__(self, transport: str, faults: FaultSet | None = None) -> None:
        self.name = transport
        self.transport = make_transport(transport)
        self.pool = self.transport.create_pool(GEOM, 64, faults=faults or FaultSet())
        self.rx = self.transport.receiver(self.pool)
        self.reservations: dict[str, Reservation] = {}
        self.events: dict[str, list[Event]] = {}

    def reserve(self, room: str, tenant: str = "acme", num_tokens: int = PROMPT) -> Reservation:
        owner = self.pool.register_owner(room)
        handles = self.pool.allocate(owner, GEOM.pages_for(num_tokens))
        res = Reservation(room, tenant, num_tokens, tuple(handles))
        self.rx.expect(res)
        self.reservations[room] = res
        return res

    def poll(self) -> None:
        for event in self.rx.poll():
            room = event.manifest.room if isinstance(event, Landed) else event.room
            self.events.setdefault(room, []).append(event)

    def wait_done(self, *rooms: str) -> None:
        """Poll (as decode's step loop would) until each room's TransferDone arrived."""
        deadline = time.monotonic() + DEADLINE_S
        while not all(self.done(r) is not None for r in rooms):
            assert time.monotonic() < deadline, f"no TransferDone for {rooms}: {self.events}"
            self.poll()
            time.sleep(0.002)

    def done(self, room: str) -> TransferDone | None:
        return next((e for e in self.events.get(room, []) if isinstance(e, TransferDone)), None)

    def landed(self, room: str) -> Landed:
        found = [e for e in self.events.get(room, []) if isinstance(e, Landed)]
        assert len(found) == 1, f"room {room}: {self.events.get(room)}"
        return found[0]

    def accept(self, room: str, reservation: Reservation) -> None:
        """What `DecodeEngine.on_transfer` does with a landed payload: reconcile it (I3)."""
        landed = self.landed(room)
        accept(landed, reservation, self.pool)

    def release_all(self) -> None:
        for res in self.reservations.values():
            self.pool.release(res.handles)
        self.reservations.clear()
        self.poll()

    def close(self) -> None:
        self.rx.close()


@contextmanager
def prefill(decode: Decode, jobs: list[Job]) -> Iterator[Connection]:
    """A prefill sender running `jobs`: a child process for the cross-process transports, a
    thread in-process."""
    parent, child = CTX.Pipe()
    if decode.name == "inprocess":
        sender = decode.transport.sender(decode.rx.address)
        worker: threading.Thread | multiprocessing.process.BaseProcess = threading.Thread(
            target=run_jobs, args=(sender, jobs, child), daemon=True
        )
    else:
        worker = CTX.Process(
            target=sender_process, args=(decode.name, decode.rx.address, jobs, child)
        )
    worker.start()
    try:
        yield parent
    finally:
        worker.join(DEADLINE_S)
        if isinstance(worker, multiprocessing.process.BaseProcess) and worker.is_alive():
            worker.kill()
            worker.join()


def accept(landed: Landed, reservation: Reservation, pool: KVPool) -> None:
    """Reconcile a landed payload against its reservation (I3), as decode does; raises
    `TransferMismatch`; marks the pages written on success."""
    checksum = landed.checksum
    if checksum is None:  # written in place: decode checksums its own pages
        checksum = payload_checksum(pool, reservation.handles, reservation.num_tokens)
    reconcile(landed.manifest, reservation, pool, checksum)
