"""Paged KV storage: the ownership ledger (kv/ledger.py) plus K/V tensors (I1, I5, I7).

Every page has a ledger row (state, owner namespace id, generation bumped on
every release, inbound flag: `OwnershipLedger`) and, here, how many token
slots from offset 0 were actually written. The ledger's columns are tensors,
so the read check (`verify`) is one vectorised comparison per batch, not a
Python loop per page.

Owners are integer namespace ids handed out by the pool (`register_owner`):
a request's own pages, or a tenant-scoped prefix-cache namespace. Ids are
never reused, so a stale handle from a released request can never match a
new owner; generations close the remaining hole (a long-lived namespace such
as a tenant's prefix cache re-acquiring the same physical page).
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvfence.faults import Fault, FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.ledger import (
    FREE_OWNER,
    Column,
    IsolationViolation,
    OwnershipLedger,
    PoolExhausted,
    SlotHandle,
    SlotState,
)
from kvfence.kv.scrub import ScrubPolicy

__all__ = [  # the ledger's names, as the KV engine spells them
    "FREE_OWNER",
    "BatchPages",
    "IsolationViolation",
    "KVPool",
    "PageHandle",
    "PageState",
    "PoolExhausted",
    "ScrubPolicy",
]

PageState = SlotState
PageHandle = SlotHandle  # a physical page at the generation it was granted, for an owner
_TORCH_KIND = {"int8": torch.int8, "int64": torch.int64, "bool": torch.bool}


def host_storage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed CPU storage on transparent huge pages where the kernel grants them.

    For a pool that another process copies into by CMA (UCX under NIXL: the copy pins
    the target's pages one at a time, and runs at half of memcpy's rate on 4 KiB pages,
    at memcpy's on 2 MiB ones). Other pools keep ordinary pages: nothing measured a
    gain for them. Anonymous memory is zero, as `torch.zeros` would be; every page is
    touched here, so the pool is resident (its huge pages assembled) at start-up,
    never on the serving path.
    """
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    region = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere the pool is on ordinary pages
        region.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    flat.zero_()  # faults every page in now
    return flat[:nbytes].view(dtype).view(shape)


def tensor_column(n: int, kind: str) -> Column:
    """Ledger columns as CPU tensors, so `verify` reads them in one vectorised gather."""
    return torch.zeros(n, dtype=_TORCH_KIND[kind])


@dataclass(frozen=True, slots=True)
class BatchPages:
    """The pages one forward step reads, padded to a rectangle.

    pages/generations/owners: [B, M] int64, the handles each row recorded.
    valid: [B, M] bool, False for padding.
    readers: [B] own owner id of each row; namespaces: [B] the prefix-cache
    namespace the row may also read (FREE_OWNER when none).
    lengths: [B] tokens attended per row (positions 0..length-1).
    """

    pages: torch.Tensor
    generations: torch.Tensor
    owners: torch.Tensor
    valid: torch.Tensor
    readers: torch.Tensor
    namespaces: torch.Tensor
    lengths: torch.Tensor

    @staticmethod
    def build(
        tables: Sequence[Sequence[PageHandle]],
        readers: Sequence[int],
        namespaces: Sequence[int],
        lengths: Sequence[int],
    ) -> BatchPages:
        rows = len(tables)
        if not len(readers) == len(namespaces) == len(lengths) == rows:
            # Mismatched lists would broadcast one row's reader over the batch in verify (I1).
            raise ValueError(
                f"BatchPages needs one reader, namespace and length per table: {rows} tables, "
                f"{len(readers)} readers, {len(namespaces)} namespaces, {len(lengths)} lengths"
            )
        width = max((len(t) for t in tables), default=0)
        pad = (0, 0, 0)
        # One tensor construction for the whole batch: this runs on every step.
        data = [
            [x for h in t for x in (h.index, h.generation, h.owner)] + list(pad) * (width - len(t))
            for t in tables
        ]
        flat = torch.tensor(data, dtype=torch.int64).reshape(rows, width, 3)
        sizes = torch.tensor([len(t) for t in tables], dtype=torch.int64)
        valid = torch.arange(width)[None, :] < sizes[:, None]
        return BatchPages(
            pages=flat[..., 0],
            generations=flat[..., 1],
            owners=flat[..., 2],
            valid=valid,
            readers=torch.tensor(list(readers), dtype=torch.int64),
            namespaces=torch.tensor(list(namespaces), dtype=torch.int64),
            lengths=torch.tensor(list(lengths), dtype=torch.int64),
        )


class KVPool(OwnershipLedger):
    """Fixed pages of `page_size` tokens; K and V shaped [layers, pages, page_size, kv_heads, head_dim].

    The ledger (`OwnershipLedger`) decides who may use which page; this class
    adds the K/V tensors, the written-slot counts and the vectorised read check.
    """

    what = "KV pool"
    unit = "pages"

    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        *,
        scrub: ScrubPolicy = ScrubPolicy.NONE,
        faults: FaultSet | None = None,
        device: str | torch.device = "cpu",
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
        huge_pages: bool = False,
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        super().__init__(num_pages, faults=faults, column=tensor_column)
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_size = geometry.page_size
        self.scrub = scrub
        shape = (
            geometry.num_layers,
            num_pages,
            geometry.page_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
        if storage is None and huge_pages and torch.device(device).type == "cpu":
            self.k = host_storage(shape, geometry.torch_dtype)
            self.v = host_storage(shape, geometry.torch_dtype)
        elif storage is None:
            self.k = torch.zeros(shape, dtype=geometry.torch_dtype, device=device)
            self.v = torch.zeros(shape, dtype=geometry.torch_dtype, device=device)
        else:
            # Shared-memory pools: the caller owns the buffers (e.g. decode's pool that prefill writes into).
            k, v = storage
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(
                    f"storage shape {tuple(k.shape)} does not match pool shape {shape}"
                )
            self.k, self.v = k, v
        # The ledger's columns are tensors (tensor_column); typed here for the read check.
        self.state: torch.Tensor
        self.owner: torch.Tensor
        self.generation: torch.Tensor
        self.inbound: torch.Tensor
        self.written = torch.zeros(num_pages, dtype=torch.int64)  # slots [0, n) hold data

    @property
    def free_pages(self) -> deque[int]:
        """The free list (the ledger's `free_slots`): LIFO, the next page handed out is last."""
        return self.free_slots

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    # ---- the ledger's hooks: the pages' contents ---------------------------------------------

    def _on_allocate(self, indices: list[int]) -> None:
        idx = torch.tensor(indices, dtype=torch.int64)
        self.written[idx] = 0
        if self.scrub is ScrubPolicy.ON_ALLOCATE:
            self._zero(idx)

    def _on_invalidate(self, index: int) -> None:
        self.written[index] = 0

    def _on_free(self, index: int) -> None:
        if self.scrub is ScrubPolicy.ON_RELEASE:
            self._zero(torch.tensor([index]))

    def _zero(self, idx: torch.Tensor) -> None:
        self.k[:, idx] = 0
        self.v[:, idx] = 0

    def _indices(self, state: SlotState) -> list[int]:
        return list((self.state == state).nonzero().flatten().tolist())

    def _values(self, column: Column, indices: list[int]) -> list[Any]:
        assert isinstance(column, torch.Tensor)
        return list(column[torch.tensor(indices, dtype=torch.int64)].tolist())

    def _count(self, state: SlotState) -> int:
        return int((self.state == state).sum())

    # ---- writes ----------------------------------------------------------------------------

    def mark_written(self, pages: torch.Tensor, upto: torch.Tensor) -> None:
        """Record that slots [0, upto) of each page now hold data (once per step, not per layer)."""
        self.written.scatter_reduce_(0, pages, upto.to(torch.int64), reduce="amax")

    def mark_pages_written(self, pages: Sequence[int], upto: Sequence[int]) -> None:
        """`mark_written` for a few pages given as ints (one landed transfer): page by page,
        since one torch scatter's fixed cost exceeds the whole loop for a short prompt."""
        written = self.written.numpy()
        for page, n in zip(pages, upto, strict=True):
            if written[page] < n:
                written[page] = n

    # ---- I1: the read check ------------------------------------------------------------------

    def verify(self, batch: BatchPages) -> None:
        """Raise `IsolationViolation` unless every page a batch reads is the reader's, now, and written.

        For each valid (row, slot): the ledger owner equals the owner recorded
        in the handle and that owner is the row's own id or its namespace; the
        generation equals the recorded one; the page is USED; and the page has
        at least as many written slots as the row attends in it. One set of
        tensor comparisons for the whole batch.
        """
        if batch.lengths.numel() == 0 or Fault.NO_LEDGER_CHECK in self.faults:
            return
        pages = batch.pages
        owner = self.owner[pages]
        gen = self.generation[pages]
        used = self.state[pages] == PageState.USED
        entitled = (batch.owners == batch.readers[:, None]) | (
            batch.owners == batch.namespaces[:, None]
        )
        slot = torch.arange(pages.shape[1], dtype=torch.int64)
        needed = (batch.lengths[:, None] - slot[None, :] * self.page_size).clamp(0, self.page_size)
        ok = (
            (owner == batch.owners)
            & (gen == batch.generations)
            & used
            & entitled
            & (self.written[pages] >= needed)
        )
        bad = batch.valid & ~ok
        # A row attending past the end of its own table would gather padding pages (I1).
        beyond = batch.lengths > batch.valid.sum(dim=1) * self.page_size
        if bool(bad.any() | beyond.any()):
            self._explain(batch, bad, beyond)

    def _explain(self, batch: BatchPages, bad: torch.Tensor, beyond: torch.Tensor) -> None:
        if not bool(bad.any()):
            row = int(beyond.nonzero()[0])
            covered = int(batch.valid[row].sum())
            raise IsolationViolation(
                f"reader {self.label(int(batch.readers[row]))} attends positions past its page table",
                page=int(batch.pages[row, covered - 1]) if covered else -1,
                expected=f"length <= {covered * self.page_size} ({covered} pages)",
                found=f"length {int(batch.lengths[row])}",
            )
        row, col = (int(x) for x in bad.nonzero()[0])
        page = int(batch.pages[row, col])
        needed = max(0, min(self.page_size, int(batch.lengths[row]) - col * self.page_size))
        raise IsolationViolation(
            f"reader {self.label(int(batch.readers[row]))} may not read position(s) in this page",
            page=page,
            expected=f"owner {self.label(int(batch.owners[row, col]))} gen {int(batch.generations[row, col])}, >= {needed} slots written",
            found=(
                f"owner {self.label(int(self.owner[page]))} gen {int(self.generation[page])}, "
                f"{int(self.written[page])} slots written, {PageState(int(self.state[page])).name.lower()}"
            ),
        )
