"""Paged KV storage with an ownership ledger (invariants I1, I5, I7).

Every page has a ledger row: its state (free / used / pending release), the
owner namespace id (0 = nobody), a generation counter bumped on every release,
how many token slots from offset 0 were actually written, and whether an
inbound transfer may still land in it. The ledger lives in tensors so the
read check (`verify`) is one vectorised comparison per batch, not a Python
loop per page.

Owners are integer namespace ids handed out by the pool (`register_owner`):
a request's own pages, or a tenant-scoped prefix-cache namespace. Ids are
never reused, so a stale handle from a released request can never match a
new owner; generations close the remaining hole (a long-lived namespace such
as a tenant's prefix cache re-acquiring the same physical page).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvfence.faults import Fault, FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.scrub import ScrubPolicy

FREE_OWNER = 0


class PageState(enum.IntEnum):
    FREE = 0
    USED = 1
    PENDING_RELEASE = 2  # released by its owner, but a transfer may still land (I7)


@dataclass(frozen=True, slots=True)
class PageHandle:
    """What a reader holds: a physical page at the generation it was granted, for an owner."""

    index: int
    generation: int
    owner: int


class PoolExhausted(Exception):
    """An allocation that does not fit. Nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: requested {requested} pages, {free} free")
        self.requested = requested
        self.free = free


class IsolationViolation(Exception):
    """A read or release that the ledger does not allow. Fails the request loudly (I1)."""

    def __init__(self, message: str, *, page: int, expected: str, found: str) -> None:
        super().__init__(
            f"isolation violation on page {page}: {message} (expected {expected}, found {found})"
        )
        self.page = page
        self.expected = expected
        self.found = found


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


class KVPool:
    """Fixed pages of `page_size` tokens; K and V shaped [layers, pages, page_size, kv_heads, head_dim]."""

    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        *,
        scrub: ScrubPolicy = ScrubPolicy.NONE,
        faults: FaultSet | None = None,
        device: str | torch.device = "cpu",
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.geometry = geometry
        self.num_pages = num_pages
        self.page_size = geometry.page_size
        self.scrub = scrub
        self.faults = faults or FaultSet()
        shape = (
            geometry.num_layers,
            num_pages,
            geometry.page_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
        if storage is None:
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
        # The ledger. Tensors so `verify` is a handful of vectorised ops per batch.
        self.state = torch.full((num_pages,), int(PageState.FREE), dtype=torch.int8)
        self.owner = torch.zeros(num_pages, dtype=torch.int64)
        self.generation = torch.zeros(num_pages, dtype=torch.int64)
        self.written = torch.zeros(num_pages, dtype=torch.int64)
        self.inbound = torch.zeros(num_pages, dtype=torch.bool)  # a transfer may still write here
        self.free_pages: deque[int] = deque(range(num_pages))
        self._owner_labels: dict[int, str] = {}
        self._next_owner = FREE_OWNER + 1

    # ---- owners -------------------------------------------------------------------------

    def register_owner(self, label: str) -> int:
        """A fresh namespace id. Ids are never reused (see module docstring)."""
        owner = self._next_owner
        self._next_owner += 1
        self._owner_labels[owner] = label
        return owner

    def forget_owner(self, owner: int) -> None:
        self._owner_labels.pop(owner, None)

    def label(self, owner: int) -> str:
        if owner == FREE_OWNER:
            return "nobody"
        return self._owner_labels.get(owner, f"owner#{owner}")

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def num_used(self) -> int:
        return int((self.state == PageState.USED).sum())

    @property
    def num_pending(self) -> int:
        return int((self.state == PageState.PENDING_RELEASE).sum())

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def can_allocate(self, n_pages: int) -> bool:
        return 0 <= n_pages <= len(self.free_pages)

    # ---- allocate / release ---------------------------------------------------------------

    def allocate(self, owner: int, n_pages: int) -> list[PageHandle]:
        """All `n_pages` pages for `owner`, or `PoolExhausted` with nothing allocated."""
        if owner == FREE_OWNER:
            raise ValueError("cannot allocate pages to the free owner")
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        if not self.can_allocate(n_pages):
            raise PoolExhausted(n_pages, len(self.free_pages))
        # LIFO: the most recently released page is reused first (cache-warm, and
        # exactly why stale contents must never be readable: I1, I5).
        indices = [self.free_pages.pop() for _ in range(n_pages)]
        idx = torch.tensor(indices, dtype=torch.int64)
        self.state[idx] = int(PageState.USED)
        self.owner[idx] = owner
        self.written[idx] = 0
        if self.scrub is ScrubPolicy.ON_ALLOCATE:
            self._zero(idx)
        gens = self.generation[idx].tolist()
        return [PageHandle(i, g, owner) for i, g in zip(indices, gens, strict=True)]

    def release(self, handles: Iterable[PageHandle]) -> None:
        """Give pages back. Invalidates (I5): owner cleared, generation bumped.

        A page with an inbound transfer that may still land is parked in
        PENDING_RELEASE and only freed by `end_inbound` (I7).
        Releasing a stale handle (double free, wrong owner) raises.
        """
        handles = list(handles)
        seen: set[int] = set()
        for h in handles:
            self._check_current(h, "release")
            if h.index in seen:  # the same page twice in one call would be a double free
                raise IsolationViolation(
                    "release lists a page twice",
                    page=h.index,
                    expected="each page once",
                    found="a duplicate handle",
                )
            seen.add(h.index)
        for h in handles:
            i = h.index
            if bool(self.inbound[i]) and Fault.EARLY_FREE not in self.faults:
                self.state[i] = int(PageState.PENDING_RELEASE)
                self._invalidate(i)
            else:
                self._free(i)

    def begin_inbound(self, handles: Iterable[PageHandle]) -> None:
        """A transfer into these pages has started and may land at any time until `end_inbound`."""
        for h in handles:
            self._check_current(h, "begin_inbound")
            self.inbound[h.index] = True

    def end_inbound(self, indices: Iterable[int]) -> None:
        """The transport confirmed the transfer finished or was cancelled (or the sender is dead)."""
        for i in indices:
            self.inbound[i] = False
            if int(self.state[i]) == PageState.PENDING_RELEASE:
                self._free(i)

    def _invalidate(self, i: int) -> None:
        if Fault.NO_INVALIDATE in self.faults:
            return  # the article's ReleaseUnsafe: owner and generation left as they were
        self.owner[i] = FREE_OWNER
        self.generation[i] += 1
        self.written[i] = 0

    def _free(self, i: int) -> None:
        self._invalidate(i)
        self.state[i] = int(PageState.FREE)
        if self.scrub is ScrubPolicy.ON_RELEASE:
            self._zero(torch.tensor([i]))
        self.free_pages.append(i)

    def _zero(self, idx: torch.Tensor) -> None:
        self.k[:, idx] = 0
        self.v[:, idx] = 0

    def _check_current(self, h: PageHandle, action: str) -> None:
        if not 0 <= h.index < self.num_pages:
            raise IsolationViolation(
                f"{action} of a page outside the pool",
                page=h.index,
                expected=f"< {self.num_pages}",
                found=str(h.index),
            )
        owner, gen, state = (
            int(self.owner[h.index]),
            int(self.generation[h.index]),
            int(self.state[h.index]),
        )
        if state != PageState.USED or owner != h.owner or gen != h.generation:
            raise IsolationViolation(
                f"{action} with a stale handle",
                page=h.index,
                expected=f"{self.label(h.owner)} gen {h.generation} used",
                found=f"{self.label(owner)} gen {gen} {PageState(state).name.lower()}",
            )

    # ---- writes ----------------------------------------------------------------------------

    def mark_written(self, pages: torch.Tensor, upto: torch.Tensor) -> None:
        """Record that slots [0, upto) of each page now hold data (once per step, not per layer)."""
        self.written.scatter_reduce_(0, pages, upto.to(torch.int64), reduce="amax")

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

    # ---- integrity ---------------------------------------------------------------------------

    def check_integrity(self, outstanding: Iterable[PageHandle] = ()) -> None:
        """Assert the ledger is consistent at a quiescent point; raise AssertionError naming the fault.

        free + used + pending = total; the free list has each free page once and
        no other; no free page has an owner; every used page has one; every
        handle still held by someone (`outstanding`) is current.
        """
        free_list = list(self.free_pages)
        if len(set(free_list)) != len(free_list):
            raise AssertionError("free list holds a page twice")
        n_free = int((self.state == PageState.FREE).sum())
        total = n_free + self.num_used + self.num_pending
        if total != self.num_pages:
            raise AssertionError(f"free {n_free} + used + pending = {total} != {self.num_pages}")
        if set(free_list) != set((self.state == PageState.FREE).nonzero().flatten().tolist()):
            raise AssertionError("free list and page states disagree")
        free_owned = (
            ((self.state == PageState.FREE) & (self.owner != FREE_OWNER))
            .nonzero()
            .flatten()
            .tolist()
        )
        if free_owned:
            raise AssertionError(f"pages {free_owned[:8]} are free but still owned")
        used_unowned = (
            ((self.state == PageState.USED) & (self.owner == FREE_OWNER))
            .nonzero()
            .flatten()
            .tolist()
        )
        if used_unowned:
            raise AssertionError(f"pages {used_unowned[:8]} are used but have no owner")
        free_inbound = ((self.state == PageState.FREE) & self.inbound).nonzero().flatten().tolist()
        if free_inbound:  # I7: a transfer may still land in a page anyone can now allocate
            raise AssertionError(f"pages {free_inbound[:8]} are free while a transfer may land")
        for h in outstanding:
            try:
                self._check_current(h, "outstanding handle")
            except IsolationViolation as e:
                raise AssertionError(str(e)) from None
