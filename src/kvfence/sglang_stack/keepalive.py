"""Prefill's word that it still holds a paired room, said from its own thread.

Decode gives up a room whose prefill half says nothing for the pair wait
(side.PAIR_TIMEOUT_S). Said between steps, that word waits for the step: one
long prefill step (a long prompt, a host under load) outlived the wait and
decode failed a room prefill was about to send. So a second thread says
`Queued` for every held room every interval, whatever the engine thread is
doing. It has its own sockets (a ZeroMQ socket belongs to one thread); the
engine thread only tells it, under a lock, which rooms it holds and where
their decode listens, and that it is still turning: the word is said only while
the engine thread's current turn began less than `step_bound_s` ago, so a hung
engine goes silent and decode fails its rooms (a long step is not a dead one,
but an engine that never ends its step must not hold a client for ever).

A `Queued` that crosses the room's end on the wire is harmless: decode acts
on it only while the room still waits for its KV.
"""

from __future__ import annotations

import threading
import time

import zmq

from kvfence.engine.messages import Queued
from kvfence.serve.channel import Outbox


class KeepAlive:
    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], interval_s: float, step_bound_s: float
    ) -> None:
        self.ctx = ctx  # a context is shared between threads; its sockets are not
        self.interval_s = interval_s
        self.step_bound_s = step_bound_s
        self._turn_began = time.monotonic()
        self._rooms: dict[str, str] = {}  # room -> decode's reply inbox
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, room: str, reply_addr: str) -> None:
        with self._lock:
            self._rooms[room] = reply_addr

    def turning(self) -> None:
        """The engine thread began a turn (it is alive; the step that follows may be long)."""
        with self._lock:
            self._turn_began = time.monotonic()

    def release(self, room: str) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvfence-keepalive", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Before the context is terminated: the thread closes its own sockets."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        boxes: dict[str, Outbox] = {}
        try:
            while not self._stopping.wait(self.interval_s):
                with self._lock:
                    hung = time.monotonic() - self._turn_began > self.step_bound_s
                    held = [] if hung else list(self._rooms.items())
                for room, addr in held:
                    box = boxes.get(addr)
                    if box is None:
                        box = boxes[addr] = Outbox(self.ctx, addr)
                    box.send(Queued(room))
        finally:
            for box in boxes.values():
                box.close()
