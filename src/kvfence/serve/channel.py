"""ZeroMQ control channels between roles.

Each role binds one PULL socket (its inbox) and connects PUSH sockets to the
inboxes of the roles it talks to. Every frame is one `encode_message` JSON
document; `Inbox.poll` validates on receipt and hands back only well-formed
messages of the types this role accepts. Anything else is logged and refused,
never raised into the worker's loop (a malformed message must not crash a
worker).

The same classes run in one process over `inproc://` addresses (tests, the
single-process mode when it wants real sockets), between the roles on one host over
`ipc://` paths (hub/launch.py), and across hosts over `tcp://`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq

from kvfence.engine.messages import Message, MessageError, decode_message, encode_message

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RefusalLog:
    """What an inbox refused, so tests and metrics can see it (bounded)."""

    count: int = 0
    recent: list[str] = field(default_factory=list)

    def add(self, reason: str) -> None:
        self.count += 1
        self.recent.append(reason)
        del self.recent[:-32]


class Waker:
    """A self-pipe that another thread sets to end a role's wait on its inbox at once.

    Decode's KV receiver sets it when a transfer lands, so the worker's loop
    reconciles and decodes straight away instead of after its idle poll timeout.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is pending already
        except OSError:
            log.debug("waker set after close")

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            return

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


class Inbox:
    """A role's bound PULL socket. Validates every frame on receipt."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], addr: str, accepts: Iterable[type]
    ) -> None:
        self.socket: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        if addr.startswith("tcp://") and addr.rsplit(":", 1)[1] == "0":
            port = self.socket.bind_to_random_port(addr.rsplit(":", 1)[0])
            addr = f"{addr.rsplit(':', 1)[0]}:{port}"
        else:
            self.socket.bind(addr)
        self.addr = addr
        self.accepts = tuple(accepts)
        self.refused = RefusalLog()
        self._poller = zmq.Poller()
        self._poller.register(self.socket, zmq.POLLIN)
        self._waker: Waker | None = None

    def wake_on(self, waker: Waker) -> None:
        """`poll` also returns (maybe empty-handed) as soon as `waker` is set."""
        self._waker = waker
        self._poller.register(waker.fileno(), zmq.POLLIN)

    def poll(self, timeout_ms: int = 0, max_messages: int = 256) -> list[Message]:
        """Well-formed, expected messages that arrived (waits up to `timeout_ms` for the first,
        or until the waker is set)."""
        out: list[Message] = []
        ready = dict(self._poller.poll(timeout_ms))
        if self._waker is not None and self._waker.fileno() in ready:
            self._waker.clear()
        if self.socket not in ready:
            return out
        while len(out) < max_messages:
            try:
                raw = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = decode_message(raw)
            except MessageError as e:
                self._refuse(f"malformed message refused: {e}")
                continue
            if not isinstance(msg, self.accepts):
                self._refuse(f"unexpected {type(msg).__name__} refused at {self.addr}")
                continue
            out.append(msg)
        return out

    def _refuse(self, reason: str) -> None:
        log.warning(reason)
        self.refused.add(reason)

    def close(self) -> None:
        self.socket.close(linger=0)


class Outbox:
    """A PUSH socket connected to another role's inbox."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], addr: str, *, hwm: int = 10_000
    ) -> None:
        self.socket: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.socket.connect(addr)
        self.addr = addr

    def send(self, msg: Message) -> None:
        self.socket.send(encode_message(msg))

    def close(self) -> None:
        self.socket.close(linger=0)
