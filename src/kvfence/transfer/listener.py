"""A receiver that listens on a loopback/host TCP socket, one thread per sender connection.

Connection threads never touch the pool ledger: they write granted pages and
queue events in the `RoomBook`; decode's thread applies them in `poll` (I7).
A malformed frame ends that connection (its granted rooms count as a dead
sender), never the receiver.
"""

from __future__ import annotations

import logging
import socket
import threading
from abc import abstractmethod
from typing import Any

from kvfence.kv.pool import KVPool
from kvfence.transfer import framing
from kvfence.transfer.base import KVReceiver, TransportClosed
from kvfence.transfer.layout import PoolShape

log = logging.getLogger(__name__)

SOCKET_BUFFER = 4 << 20


def tune(sock: socket.socket) -> None:
    """Large buffers and no Nagle: payloads are big, control frames are latency-bound."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


class ListeningReceiver(KVReceiver):
    scheme: str = "tcp"

    def __init__(self, pool: KVPool, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(pool)
        self._listener = socket.create_server((host, port))
        self._host, self._port = self._listener.getsockname()[:2]
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"{self.scheme}://{self._host}:{self._port}"

    def hello(self) -> dict[str, Any]:
        return PoolShape(self.pool.geometry, self.pool.num_pages).to_json()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            tune(conn)
            thread = threading.Thread(target=self._run, args=(conn,), daemon=True)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
                self._threads.append(thread)
            thread.start()

    def _run(self, conn: socket.socket) -> None:
        granted: set[str] = set()
        try:
            framing.send_json(conn, framing.HELLO, self.hello())
            self.serve(conn, granted)
        except (TransportClosed, OSError) as e:
            if granted:
                log.warning("sender gone with %d transfer(s) in flight: %s", len(granted), e)
        except Exception:
            # A frame this receiver cannot handle ends that connection, never the receiver.
            log.exception("dropped a sender connection after an unexpected error")
        finally:
            # A dead or closed sender writes nothing more: confirm its rooms as ended (I7).
            self.book.lost(sorted(granted))
            conn.close()

    @abstractmethod
    def serve(self, conn: socket.socket, granted: set[str]) -> None:
        """Handle frames until the sender closes; keep `granted` = rooms granted and not ended."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        # close() alone does not wake the acceptor blocked in accept() (Linux): shutdown does,
        # so close returns at once instead of after the join's timeout.
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            log.debug("listener already shut down")
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                log.debug("connection already closed")
            conn.close()
        self._acceptor.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)
