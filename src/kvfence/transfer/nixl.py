"""NIXL backend (UCX): prefill's agent WRITEs decode's registered pool, with a notification.

Decode's K/V storage is registered with a NIXL agent as DRAM (VRAM on GPU
pools). The hello carries the agent's metadata and the base addresses of K
and V; a sender adds decode's agent (`add_remote_agent`) and names its own
agent on the control socket (an `A` frame). A granted transfer is one WRITE
whose descriptors are the copy runs and whose notification carries the room
and the checksum of what was sent; decode's `poll` collects notifications and
ends a room only on one from the agent the room was granted to. The E frame
the sender sends after the WRITE completes ends it otherwise (whichever comes
first); a closed control socket before either is a dead sender (I7).

NIXL refuses a write outside every registered range (NIXL_ERR_NOT_FOUND) but,
like Mooncake, knows no pages: the grant, the inbound windows (I7) and
reconciliation (I3) stay in kvfence (`granted.py`).

Progress: NIXL's own progress thread polls UCX with no pause (its Python API fixes
the delay at 0), so each agent spent a core of a 2-core host doing nothing, and the
stack over NIXL ran at half of TCP's pace. The agents run without it. A sender's
engine drives its own agent while it waits for a WRITE to end; decode's receiver
asks its agent for notifications every `PUMP_S` on a thread of its own, which also
drives decode's side of UCX (a WRITE, and a connection's set-up, need the target to
make progress too), whatever decode's engine thread is doing, and ends each room
the moment its notification comes.

Needs `nixl-cu12` (installed with --no-deps: its core, UCX and POSIX plugins
link no CUDA library; `make pd`).
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool
from kvfence.transfer import framing
from kvfence.transfer.base import Event, KVTransport, TransportClosed
from kvfence.transfer.granted import (
    CHUNK_BYTES,
    GrantedSender,
    GrantingReceiver,
    chunked,
    parse_end,
    storage_addresses,
)
from kvfence.transfer.layout import Outgoing

log = logging.getLogger(__name__)

AGENT = b"A"  # sender -> decode: the name of the sender's NIXL agent
# How often decode's receiver asks its agent for notifications (and so drives its progress):
# a room's end is seen within this long of its WRITE, for a few hundred wake-ups a second.
PUMP_S = 0.002
POLL_S = 50e-6  # a sender's pause between asking whether its WRITE ended


class NixlAgent:
    """One NIXL agent (UCX) and the host memory registered with it; calls are serialised."""

    def __init__(self, role: str) -> None:
        from nixl_cu12 import nixl_agent, nixl_agent_config  # `make pd`

        self.name = f"kvfence-{role}-{uuid.uuid4().hex[:12]}"
        # No progress thread (it busy-polls): the module docstring says who drives progress.
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = nixl_agent(self.name, config)
        self._pools: dict[int, tuple[tuple[tuple[int, int], tuple[int, int]], Any]] = {}
        self._lock = threading.Lock()

    def register(self, pool: KVPool) -> tuple[tuple[int, int], tuple[int, int]]:
        """Register the pool's K and V storage as DRAM while the pool lives (see mooncake.py)."""
        with self._lock:
            known = self._pools.get(id(pool))
            if known is not None:
                return known[0]
            regions = storage_addresses(pool)
            descs = self._agent.register_memory([(a, n, 0, "") for a, n in regions], "DRAM")
            self._pools[id(pool)] = (regions, descs)
        weakref.finalize(pool, self._unregister, id(pool)).atexit = False
        return regions

    def _unregister(self, key: int) -> None:
        with self._lock:
            known = self._pools.pop(key, None)
            if known is not None:
                self._agent.deregister_memory(known[1])

    def metadata(self) -> str:
        with self._lock:
            return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def add_remote(self, metadata: str) -> str:
        with self._lock:
            name = self._agent.add_remote_agent(base64.b64decode(metadata))
        return name.decode() if isinstance(name, bytes) else str(name)

    def write(self, remote: str, src: np.ndarray, dst: np.ndarray, notif: bytes) -> str:
        """One WRITE of (address, length, 0) rows with a notification; "DONE" or "ERR"."""
        with self._lock:
            local = self._agent.get_xfer_descs(src, "DRAM")
            far = self._agent.get_xfer_descs(dst, "DRAM")
            handle = self._agent.initialize_xfer("WRITE", local, far, remote, notif)
            state = self._agent.transfer(handle)
        try:
            while state == "PROC":
                # NIXL's calls hold the GIL: a poll loop without a pause would hand it to the
                # sender's checksum thread (granted.py) only once per switch interval (5 ms).
                time.sleep(POLL_S)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            return str(state)
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        """(sending agent, message) received since the last call; never blocks."""
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [(str(agent), msg) for agent, msgs in notifs.items() for msg in msgs]


class NixlReceiver(GrantingReceiver):
    scheme = "nixl"

    def __init__(self, pool: KVPool, agent: NixlAgent, host: str, port: int) -> None:
        self._agent = agent
        (self._k_addr, _), (self._v_addr, _) = agent.register(pool)
        self._metadata = agent.metadata()
        super().__init__(pool, host, port)
        self._stopping = threading.Event()
        self._pump = threading.Thread(target=self._run_pump, name="kvfence-nixl", daemon=True)
        self._pump.start()

    def engine_hello(self) -> dict[str, Any]:
        return {"metadata": self._metadata, "k_addr": self._k_addr, "v_addr": self._v_addr}

    def peer_frame(self, kind: bytes, body: bytes, peer: dict[str, str]) -> bool:
        if kind != AGENT or "engine" in peer:
            return False
        peer["engine"] = body.decode(errors="replace")
        return True

    def _run_pump(self) -> None:
        try:
            while not self._stopping.wait(PUMP_S):
                self._collect()
        except Exception:
            # Said once, not 500 times a second; decode's poll still collects every turn.
            log.exception("NIXL notification pump stopped; decode's own polls go on")

    def _collect(self) -> None:
        """End each room whose WRITE's notification came (its `Landed` wakes decode)."""
        for agent, msg in self._agent.notifications():
            try:
                room, checksum = parse_end(msg)
            except TransportClosed as e:
                log.warning("ignored a NIXL notification from %s: %s", agent, e)
                continue
            if not self.finish(room, checksum, agent):
                # Already ended by its E frame, or not granted to this agent: ignored.
                log.debug("no open grant of room %r for agent %s", room, agent)

    def poll(self) -> list[Event]:
        self._collect()
        return super().poll()

    def close(self) -> None:
        self._stopping.set()
        self._pump.join(1.0)
        super().close()


class NixlSender(GrantedSender):
    checksum_beside_writes = True  # a third off a 256 MiB transfer (bench/transfer.py)

    def __init__(self, address: str, agent: NixlAgent, chunk_bytes: int) -> None:
        super().__init__(address, "nixl", chunk_bytes)
        self._agent = agent
        self._remote = agent.add_remote(str(self.hello["metadata"]))
        self._dst_base = (int(self.hello["k_addr"]), int(self.hello["v_addr"]))
        framing.send_frame(self._sock, AGENT, agent.name.encode())

    def write(self, out: Outgoing, end: Callable[[], bytes]) -> str | None:
        src_base = tuple(addr for addr, _ in self._agent.register(out.src_pool))
        chunks = chunked(out.copy_runs(), self.chunk_bytes)
        for i, (runs, upto) in enumerate(chunks):
            rows = np.asarray(runs, dtype=np.int64)  # kind, src offset, dst offset, length
            kinds, lengths = rows[:, 0], rows[:, 3]
            zeros = np.zeros(len(rows), dtype=np.int64)
            src = np.stack([np.asarray(src_base)[kinds] + rows[:, 1], lengths, zeros], axis=1)
            dst = np.stack([np.asarray(self._dst_base)[kinds] + rows[:, 2], lengths, zeros], axis=1)
            last = i + 1 == len(chunks)
            state = self._agent.write(self._remote, src, dst, end() if last else b"")
            if state != "DONE":
                return f"NIXL WRITE ended in state {state}"
            if not last:  # DONE: written there; decode checksums it while the next goes
                self.send_progress(out.manifest.room, upto)
        # The notification may end the room first; the E frame is the ordered confirmation,
        # so a sender that closes right after its write is never counted dead mid-transfer.
        self.send_end(end())
        return None


class NixlTransport(KVTransport):
    name = "nixl"

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.host = host
        self.port = port
        self.chunk_bytes = chunk_bytes  # 0: one WRITE per room, decode checks after the end
        self._agents: dict[str, NixlAgent] = {}  # one per role, shared by that role's halves

    def agent(self, role: str) -> NixlAgent:
        if role not in self._agents:
            self._agents[role] = NixlAgent(role)
        return self._agents[role]

    def create_pool(self, geometry: KVGeometry, num_pages: int, **pool_options: Any) -> KVPool:
        """Decode's pool on huge pages: UCX's CMA copy into it then runs at memcpy's rate."""
        return KVPool(geometry, num_pages, huge_pages=True, **pool_options)

    def receiver(self, pool: KVPool) -> NixlReceiver:
        return NixlReceiver(pool, self.agent("decode"), self.host, self.port)

    def sender(self, address: str) -> NixlSender:
        return NixlSender(address, self.agent("prefill"), self.chunk_bytes)
