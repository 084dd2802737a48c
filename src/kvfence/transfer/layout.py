"""Page layout of a transfer: where each byte comes from and goes, and the copy runs.

`prepare_outgoing` turns an engine `OutboundTransfer` into an `Outgoing`:
the manifest plus parallel arrays of (kind, source offset, destination
offset, length), one row per (K or V, layer, page) in canonical order. Every
backend moves those bytes its own way (a stream, an in-place copy, RDMA
descriptors); the checksum always covers the canonical source runs, which is
what decode verifies (I3).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfence.engine.messages import TransferManifest
from kvfence.engine.prefill import OutboundTransfer
from kvfence.engine.reconcile import StreamChecksum, coalesce, payload_checksum, payload_segments
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import KVPool


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What a sender must know about the receiver's pool to address its pages."""

    geometry: KVGeometry
    num_pages: int

    def to_json(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "num_layers": g.num_layers,
            "num_kv_heads": g.num_kv_heads,
            "head_dim": g.head_dim,
            "page_size": g.page_size,
            "dtype": g.dtype,
            "num_pages": self.num_pages,
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> PoolShape:
        geometry = KVGeometry(
            num_layers=int(obj["num_layers"]),
            num_kv_heads=int(obj["num_kv_heads"]),
            head_dim=int(obj["head_dim"]),
            page_size=int(obj["page_size"]),
            dtype=str(obj["dtype"]),
        )
        return PoolShape(geometry, int(obj["num_pages"]))


@dataclass(slots=True)
class Outgoing:
    """A prepared transfer: the manifest and, per canonical segment, where bytes come from and go.

    Arrays are parallel, one row per (kind, layer, page) in canonical order:
    kind (0 = K, 1 = V), src/dst byte offsets into the K or V storage,
    lengths and the page position in the table.
    """

    manifest: TransferManifest
    src_pool: KVPool
    kinds: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    positions: np.ndarray
    # The source runs as prepared (kind, offset, length): what the checksum covers,
    # whatever happens to the arrays above before transmission.
    canonical: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def payload_bytes(self) -> int:
        return int(self.lengths.sum())

    def src_runs(self) -> list[tuple[int, int, int]]:
        """(kind, src offset, length), merged where the source is contiguous: the stream order."""
        return [(k, s, n) for k, s, _, n in self._runs(check_dst=False)]

    def copy_runs(self) -> list[tuple[int, int, int, int]]:
        """(kind, src offset, dst offset, length), merged where both sides are contiguous."""
        return self._runs(check_dst=True)

    def _runs(self, *, check_dst: bool) -> list[tuple[int, int, int, int]]:
        k, s, d, n = self.kinds, self.src_offsets, self.dst_offsets, self.lengths
        if len(k) == 0:
            return []
        follows = (k[1:] == k[:-1]) & (s[1:] == s[:-1] + n[:-1])
        if check_dst:
            follows &= d[1:] == d[:-1] + n[:-1]
        starts = np.flatnonzero(np.concatenate([[True], ~follows]))
        ends = np.concatenate([starts[1:], [len(k)]])
        sums = np.concatenate([[0], np.cumsum(n)])
        cols = (k[starts], s[starts], d[starts], sums[ends] - sums[starts])
        return list(zip(*(c.tolist() for c in cols), strict=True))


def prepare_outgoing(
    transfer: OutboundTransfer,
    src_pool: KVPool,
    dest_shape: PoolShape,
    *,
    checksum_now: bool = True,
) -> Outgoing:
    """Lay out a transfer and write its manifest (the checksum is over the source pages).

    The first `transfer.num_tokens` positions of `transfer.src_pages` (in
    `src_pool`) go to the destination pages decode granted.

    With `checksum_now=False` the manifest's checksum is left empty: the sender
    fills it while it copies (`copy_runs_into`), saving a pass over the payload.
    """
    num_tokens, dest, src_handles = transfer.num_tokens, transfer.dest_pages, transfer.src_pages
    if src_pool.geometry != dest_shape.geometry:
        raise ValueError(
            f"sender geometry {src_pool.geometry} != receiver geometry {dest_shape.geometry}"
        )
    if num_tokens < 1:
        raise ValueError(f"a transfer carries at least one token, got {num_tokens}")
    num_pages = src_pool.geometry.pages_for(num_tokens)
    if len(dest) < num_pages:
        raise ValueError(f"{num_tokens} tokens need {num_pages} destination pages, got {len(dest)}")
    src_idx = [h.index for h in src_handles]
    kinds, src_off, lengths, positions = payload_segments(src_pool, src_idx, num_tokens)
    dst_off = _dest_offsets(dest_shape, [r.index for r in dest[:num_pages]], positions, kinds)
    manifest = TransferManifest(
        room=transfer.room,
        tenant=transfer.tenant,
        num_tokens=num_tokens,
        num_pages=num_pages,
        dest_pages=tuple(dest),
        checksum=payload_checksum(src_pool, src_handles, num_tokens) if checksum_now else "",
        first_token=transfer.first_token,
        first_logprobs=transfer.first_logprobs,
        cached_tokens=transfer.cached_tokens,
        prefill_s=transfer.prefill_s,
    )
    canonical = coalesce(kinds, src_off, lengths)
    return Outgoing(manifest, src_pool, kinds, src_off, dst_off, lengths, positions, canonical)


def _dest_offsets(
    shape: PoolShape, dest_idx: list[int], positions: np.ndarray, kinds: np.ndarray
) -> np.ndarray:
    g = shape.geometry
    if any(not 0 <= i < shape.num_pages for i in dest_idx):
        raise ValueError(f"destination pages {dest_idx} outside a pool of {shape.num_pages}")
    tb = g.num_kv_heads * g.head_dim * g.dtype_bytes
    per_kind = len(kinds) // 2
    layer = (np.arange(len(kinds)) % per_kind) // max(len(dest_idx), 1)
    pages = np.asarray(dest_idx, dtype=np.int64)[positions]
    return (layer * shape.num_pages + pages) * (g.page_size * tb)


COPY_CHUNK = 1 << 20  # copy then checksum a MiB at a time, while it is still in cache


def copy_runs_into(
    out: Outgoing,
    dst: tuple[memoryview, memoryview],
    src: tuple[memoryview, memoryview],
    progress: Callable[[int], None] | None = None,
    every: int = 0,
) -> str:
    """Write a prepared transfer straight into destination memory; return the source checksum.

    The checksum covers the canonical source runs (what the manifest promises),
    computed right after each piece is copied, so it costs no extra pass over memory.
    Where the copy runs still follow the canonical order (they split it only where the
    destination is not contiguous) each run is copied and hashed as it stands; where
    the arrays changed after `prepare_outgoing` (the transport tests tamper with them:
    a truncated, duplicated or reordered payload), a cursor walks the canonical runs
    beside the copy instead.

    `progress(upto)` is called each time another `every` bytes are written (never after
    the last piece): the first `upto` payload bytes are in place, in canonical order, so
    the receiver may read them while the rest is copied. A tampered layout reports none.
    """
    runs = out.copy_runs()
    if out.src_runs() != out.canonical:
        return _copy_beside_cursor(out, runs, dst, src)
    total = sum(n for *_, n in runs)
    h = StreamChecksum()
    update = h.update
    done = reported = 0
    for kind, s, d, n in runs:
        for start in range(s, s + n, COPY_CHUNK):
            piece = src[kind][start : min(start + COPY_CHUNK, s + n)]
            dst[kind][d + start - s : d + start - s + len(piece)] = piece
            update(piece)
            done += len(piece)
            if progress is not None and every > 0 and done - reported >= every and done < total:
                progress(done)
                reported = done
    return h.hexdigest()


def _copy_beside_cursor(
    out: Outgoing,
    runs: list[tuple[int, int, int, int]],
    dst: tuple[memoryview, memoryview],
    src: tuple[memoryview, memoryview],
) -> str:
    dst_np = (np.frombuffer(dst[0], np.uint8), np.frombuffer(dst[1], np.uint8))
    src_np = (np.frombuffer(src[0], np.uint8), np.frombuffer(src[1], np.uint8))
    cursor = ChecksumCursor(out.canonical, src)
    for kind, s, d, n in runs:
        for start in range(0, n, COPY_CHUNK):
            m = min(COPY_CHUNK, n - start)
            np.copyto(
                dst_np[kind][d + start : d + start + m], src_np[kind][s + start : s + start + m]
            )
            cursor.advance(m)
    return cursor.finish()


class ChecksumCursor:
    """Checksums runs (kind, offset, length) of a pool's bytes in order, some bytes at a time."""

    def __init__(
        self, runs: list[tuple[int, int, int]], src: tuple[memoryview, memoryview]
    ) -> None:
        self._runs = deque(runs)
        self._src = src
        self._h = StreamChecksum()

    def advance(self, nbytes: int) -> None:
        while nbytes > 0 and self._runs:
            kind, off, n = self._runs[0]
            take = min(n, nbytes)
            self._h.update(self._src[kind][off : off + take])
            nbytes -= take
            if take == n:
                self._runs.popleft()
            else:
                self._runs[0] = (kind, off + take, n - take)

    def finish(self) -> str:
        self.advance(sum(n for _, _, n in self._runs))
        return self._h.hexdigest()


def receive_layout(pool: KVPool, manifest: TransferManifest) -> list[tuple[int, int, int]]:
    """Where a granted payload goes in decode's pool, in stream order (kind, offset, length)."""
    kinds, offsets, lengths, _ = payload_segments(
        pool, [r.index for r in manifest.dest_pages], manifest.num_tokens
    )
    return coalesce(kinds, offsets, lengths)
