"""Reservation/transfer reconciliation (invariant I3), pure: no process, no network.

Decode reserves pages for exactly the prompt length when it bootstraps a
request (`Reservation`). Prefill later ships the KV with a `TransferManifest`
saying what it sent. Before a single token is decoded, `reconcile` checks the
manifest against the reservation field by field and the payload checksum
against what actually landed in the reserved pages. Only then are the pages
marked written, so the I1 read check never lets attention into a slot that no
verified transfer filled.

The checksum (`payload_checksum`) covers exactly the K and V bytes of the first
`num_tokens` positions, in a canonical order (K then V, layer by layer, the
reserved pages in table order, written slots only). It is a streaming xxh3-64
over memory runs, so it costs one read of the payload; it detects a flipped
byte, a missing or duplicated page and two pages swapped (the order is part of
the stream). It guards against accidents in transit, not against a forger.

The SGLang #30233 shape: a rejected request's 1-token placeholder is prefilled,
one page is sent, "done" is signalled, and decode attends all 8 pages it
reserved. Here that manifest fails on `num_tokens` and nothing is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvfence.engine.messages import PageRef, TransferManifest
from kvfence.faults import Fault
from kvfence.kv.pool import KVPool, PageHandle, PageState

CHECKSUM_ALGO = "xxh3-64"


@dataclass(frozen=True, slots=True)
class Reservation:
    """Pages decode reserved for one request's prompt, at the generations it was granted."""

    room: str
    tenant: str
    num_tokens: int
    handles: tuple[PageHandle, ...]

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"a reservation needs at least one token, got {self.num_tokens}")

    @property
    def num_pages(self) -> int:
        return len(self.handles)

    @property
    def refs(self) -> tuple[PageRef, ...]:
        """The destination handles as sent to prefill (BootstrapReady / PrefillWork)."""
        return tuple(PageRef(h.index, h.generation) for h in self.handles)


class TransferMismatch(Exception):
    """A transfer that does not match its reservation. The request fails; nothing is decoded (I3)."""

    def __init__(self, field: str, expected: object, found: object) -> None:
        super().__init__(
            f"transfer mismatch on {field}: reservation expects {expected}, transfer has {found}"
        )
        self.field = field
        self.expected = expected
        self.found = found


# ---- payload layout -------------------------------------------------------------------------


def token_bytes_per_layer(pool: KVPool) -> int:
    """Bytes of one token's K (or V) in one layer."""
    g = pool.geometry
    return g.num_kv_heads * g.head_dim * g.dtype_bytes


def payload_bytes(pool: KVPool, num_tokens: int) -> int:
    return num_tokens * pool.geometry.bytes_per_token


def payload_segments(
    pool: KVPool, page_indices: Sequence[int], num_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The canonical payload order as arrays (kind, byte offset, byte length, page position).

    kind 0 is K and 1 is V; offsets are into that tensor's flat bytes. One row per
    (kind, layer, page): the first `num_tokens` positions spread over the pages
    in table order, written slots only.
    """
    g = pool.geometry
    n_pages = g.pages_for(num_tokens)
    if num_tokens < 0 or n_pages > len(page_indices):
        raise ValueError(f"{num_tokens} tokens need {n_pages} pages, got {len(page_indices)}")
    tb = token_bytes_per_layer(pool)
    pages = np.asarray(page_indices[:n_pages], dtype=np.int64)
    pos = np.arange(n_pages, dtype=np.int64)
    fill = np.clip(num_tokens - pos * g.page_size, 0, g.page_size)
    layers = np.arange(g.num_layers, dtype=np.int64)
    base = (layers[:, None] * pool.num_pages + pages[None, :]) * (g.page_size * tb)
    offsets = np.concatenate([base.ravel(), base.ravel()])
    lengths = np.tile(fill * tb, 2 * g.num_layers)
    kinds = np.repeat(np.array([0, 1], dtype=np.int64), g.num_layers * n_pages)
    positions = np.tile(pos, 2 * g.num_layers)
    return kinds, offsets, lengths, positions


def coalesce(
    kinds: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
) -> list[tuple[int, int, int]]:
    """Merge rows that follow each other in memory into (kind, offset, length) runs."""
    if len(offsets) == 0:
        return []
    follows = (kinds[1:] == kinds[:-1]) & (offsets[1:] == offsets[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~follows]))
    ends = np.concatenate([starts[1:], [len(offsets)]])
    sums = np.concatenate([[0], np.cumsum(lengths)])
    # Whole columns to Python ints at once: a numpy scalar per field costs more than the rest.
    cols = (kinds[starts].tolist(), offsets[starts].tolist(), (sums[ends] - sums[starts]).tolist())
    return list(zip(*cols, strict=True))


def byte_views(pool: KVPool) -> tuple[memoryview, memoryview]:
    """Flat writable byte views of the pool's K and V storage (CPU, contiguous)."""
    return _byte_view(pool.k), _byte_view(pool.v)


def _byte_view(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("KV storage must be contiguous CPU memory for byte-level transfer")
    return t.view(torch.uint8).reshape(-1).numpy().data


class StreamChecksum:
    """The checksum of a payload fed in canonical order, piece by piece (as it lands)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"{CHECKSUM_ALGO}:{self._h.hexdigest()}"


def payload_checksum(pool: KVPool, handles: Sequence[PageHandle | PageRef], num_tokens: int) -> str:
    """Checksum over exactly the K/V bytes of the first `num_tokens` positions of these pages."""
    kinds, offsets, lengths, _ = payload_segments(pool, [h.index for h in handles], num_tokens)
    views = byte_views(pool)
    h = StreamChecksum()
    update = h.update
    for kind, off, n in coalesce(kinds, offsets, lengths):
        update(views[kind][off : off + n])
    return h.hexdigest()


# ---- I3: the check ------------------------------------------------------------------------


def reconcile(
    manifest: TransferManifest,
    reservation: Reservation,
    pool: KVPool,
    payload_checksum: str,
) -> None:
    """Raise `TransferMismatch` unless the transfer is exactly what was reserved; then mark it written.

    `payload_checksum` is the checksum of what landed in the reserved pages
    (computed by the receiver, never copied from the manifest). Checked in
    order: room, tenant, token count, page count, destination pages (index and
    generation), the pages still current in the ledger, checksum.
    Under the lab's `decode-trusts-bootstrap` switch the checks are skipped
    (the bug); what is marked written is still only what the manifest says
    landed, so the I1 read check remains a second, independent defence.
    """
    if Fault.DECODE_TRUSTS_BOOTSTRAP not in pool.faults:
        _check_fields(manifest, reservation, pool)
        _check_current(reservation, pool)
        if payload_checksum != manifest.checksum:
            raise TransferMismatch("checksum", payload_checksum, manifest.checksum)
    _mark_landed(manifest, reservation, pool)


def _check_fields(manifest: TransferManifest, res: Reservation, pool: KVPool) -> None:
    expected_pages = pool.geometry.pages_for(res.num_tokens)
    for field, want, got in (
        ("room", res.room, manifest.room),
        ("tenant", res.tenant, manifest.tenant),
        ("num_tokens", res.num_tokens, manifest.num_tokens),
        ("num_pages", expected_pages, manifest.num_pages),
        ("reserved pages", expected_pages, res.num_pages),
        ("dest_pages count", res.num_pages, len(manifest.dest_pages)),
    ):
        if want != got:
            raise TransferMismatch(field, want, got)
    # The handles themselves, not `res.refs`: building a PageRef per page costs more than
    # the comparison on a long prompt.
    for pos, (handle, ref) in enumerate(zip(res.handles, manifest.dest_pages, strict=True)):
        if handle.index != ref.index or handle.generation != ref.generation:
            raise TransferMismatch(
                f"dest_pages[{pos}]",
                f"page {handle.index} gen {handle.generation}",
                f"page {ref.index} gen {ref.generation}",
            )


def _check_current(res: Reservation, pool: KVPool) -> None:
    """The reserved pages are still this request's, at the granted generation (not released meanwhile)."""
    # Page by page over numpy views of the ledger's columns: a reservation is a handful of
    # pages to a few hundred, and right after a transfer (caches cold) each torch call's
    # fixed cost was most of a short transfer's reconciliation.
    state, generation, owner = (_column(c) for c in (pool.state, pool.generation, pool.owner))
    used = int(PageState.USED)
    for h in res.handles:
        i = h.index
        if state[i] != used or generation[i] != h.generation or owner[i] != h.owner:
            raise TransferMismatch(
                f"ledger page {i}",
                f"{pool.label(h.owner)} gen {h.generation} used",
                f"{pool.label(int(owner[i]))} gen {int(generation[i])} "
                f"{PageState(int(state[i])).name.lower()}",
            )


def _column(t: torch.Tensor) -> np.ndarray:
    """A ledger column as numpy, without a copy where it lives in CPU memory."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def _mark_landed(manifest: TransferManifest, res: Reservation, pool: KVPool) -> None:
    """Slots written = what the manifest says landed, within the reserved pages only."""
    n_pages = min(pool.geometry.pages_for(max(manifest.num_tokens, 0)), res.num_pages)
    size = pool.page_size
    upto = [min(max(manifest.num_tokens - pos * size, 0), size) for pos in range(n_pages)]
    pool.mark_pages_written([h.index for h in res.handles[:n_pages]], upto)
