"""The ownership ledger of a fixed pool of slots (I1, I5, I7), whatever the slots hold.

The incident's lesson generalises (INCIDENT.md, "The general pattern"): any
fixed pool of slots that requests borrow (KV pages, session slots, player
state buffers, connection buffers) needs three things, and this ledger is
them, with no tensors and no model:

* **all-or-nothing allocation**: `allocate(owner, n)` hands out all `n`
  slots or raises `PoolExhausted` with nothing allocated, so a refused
  reservation leaves no trace;
* **invalidate on release (I5)**: `release` clears the owner and bumps the
  slot's generation, so a handle kept past its release never matches again;
* **verify on every use (I1)**: a `SlotHandle` carries (index, generation,
  owner); `check_current` raises `IsolationViolation` unless the ledger
  still says that slot is that owner's at that generation. A stale handle
  fails loudly instead of reading someone else's data.

A fourth rule comes from PD transfers (I7): a slot that a late writer may
still hit (`begin_inbound`) is parked in PENDING_RELEASE when released and
freed only by `end_inbound`.

Each slot's row lives in four columns (state, owner, generation, inbound).
A column is anything indexable by slot number: plain lists for `SlotPool`,
CPU tensors for `KVPool`, whose read check is then one vectorised comparison
per batch. Owners are integer ids handed
out by `register_owner` and never reused.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvfence.faults import Fault, FaultSet

FREE_OWNER = 0

Column = Any  # indexable by slot number: a list (SlotPool), a tensor (KVPool)
ColumnFactory = Callable[[int, str], Column]  # (length, kind: "int8" | "int64" | "bool")


def list_column(n: int, kind: str) -> Column:
    """Plain Python lists: the ledger with no dependency at all."""
    return [False if kind == "bool" else 0] * n


class SlotState(enum.IntEnum):
    FREE = 0
    USED = 1
    PENDING_RELEASE = 2  # released by its owner, but a late write may still land (I7)


@dataclass(frozen=True, slots=True)
class SlotHandle:
    """What a borrower holds: a slot at the generation it was granted, for an owner."""

    index: int
    generation: int
    owner: int


class PoolExhausted(Exception):
    """An allocation that does not fit. Nothing was allocated."""

    def __init__(self, requested: int, free: int, *, what: str = "KV pool", unit: str = "pages"):
        super().__init__(f"{what} exhausted: requested {requested} {unit}, {free} free")
        self.requested = requested
        self.free = free


class IsolationViolation(Exception):
    """A use or release the ledger does not allow. Fails the request loudly (I1).

    `page` is the slot's index (a KV page in `KVPool`).
    """

    def __init__(self, message: str, *, page: int, expected: str, found: str) -> None:
        super().__init__(
            f"isolation violation on page {page}: {message} (expected {expected}, found {found})"
        )
        self.page = page
        self.expected = expected
        self.found = found


class OwnershipLedger:
    """Slots `0..num_slots-1` with owner, generation and state; see the module docstring.

    Subclasses attach the slots' contents: `_on_allocate(indices)` and
    `_on_invalidate(index)` are where contents are set up and reset.
    """

    what = "pool"  # in messages: "<what> exhausted"
    unit = "slots"

    def __init__(
        self, num_slots: int, *, faults: FaultSet | None = None, column: ColumnFactory = list_column
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"a {self.what} needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.faults = faults or FaultSet()
        self.state = column(num_slots, "int8")
        self.owner = column(num_slots, "int64")
        self.generation = column(num_slots, "int64")
        self.inbound = column(num_slots, "bool")  # a late write may still land here (I7)
        self.free_slots: deque[int] = deque(range(num_slots))
        self._owner_labels: dict[int, str] = {}
        self._next_owner = FREE_OWNER + 1

    # ---- owners -------------------------------------------------------------------------

    def register_owner(self, label: str) -> int:
        """A fresh owner id. Ids are never reused, so an old handle never matches a new owner."""
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
        return len(self.free_slots)

    @property
    def num_used(self) -> int:
        return self._count(SlotState.USED)

    @property
    def num_pending(self) -> int:
        return self._count(SlotState.PENDING_RELEASE)

    def _count(self, state: SlotState) -> int:
        return len(self._indices(state))

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self.free_slots)

    # ---- allocate / release ---------------------------------------------------------------

    def allocate(self, owner: int, n: int) -> list[SlotHandle]:
        """All `n` slots for `owner`, or `PoolExhausted` with nothing allocated."""
        if owner == FREE_OWNER:
            raise ValueError(f"cannot allocate {self.unit} to the free owner")
        if n < 0:
            raise ValueError(f"n_{self.unit} must be >= 0, got {n}")
        if not self.can_allocate(n):
            raise PoolExhausted(n, len(self.free_slots), what=self.what, unit=self.unit)
        # LIFO: the most recently released slot is reused first (cache-warm, and
        # exactly why stale contents must never be readable: I1, I5).
        indices = [self.free_slots.pop() for _ in range(n)]
        for i in indices:
            self.state[i] = SlotState.USED
            self.owner[i] = owner
        self._on_allocate(indices)
        return [SlotHandle(i, int(self.generation[i]), owner) for i in indices]

    def release(self, handles: Iterable[SlotHandle]) -> None:
        """Give slots back. Invalidates (I5): owner cleared, generation bumped.

        A slot a late write may still hit is parked in PENDING_RELEASE and only
        freed by `end_inbound` (I7). Releasing a stale handle (double free,
        wrong owner) raises, and then nothing is released.
        """
        handles = list(handles)
        seen: set[int] = set()
        for h in handles:
            self.check_current(h, "release")
            if h.index in seen:  # the same slot twice in one call would be a double free
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
                self.state[i] = SlotState.PENDING_RELEASE
                self._invalidate(i)
            else:
                self._free(i)

    def begin_inbound(self, handles: Iterable[SlotHandle]) -> None:
        """A write into these slots has started and may land at any time until `end_inbound`."""
        for h in handles:
            self.check_current(h, "begin_inbound")
            self.inbound[h.index] = True

    def end_inbound(self, indices: Iterable[int]) -> None:
        """The writer confirmed it finished or was cancelled (or is known dead)."""
        for i in indices:
            self.inbound[i] = False
            if int(self.state[i]) == SlotState.PENDING_RELEASE:
                self._free(i)

    def _invalidate(self, i: int) -> None:
        if Fault.NO_INVALIDATE in self.faults:
            return  # the article's ReleaseUnsafe: owner and generation left as they were
        self.owner[i] = FREE_OWNER
        self.generation[i] += 1
        self._on_invalidate(i)

    def _free(self, i: int) -> None:
        self._invalidate(i)
        self.state[i] = SlotState.FREE
        self._on_free(i)
        self.free_slots.append(i)

    # ---- hooks for the slots' contents ------------------------------------------------------

    def _on_allocate(self, indices: list[int]) -> None:
        """Slots just handed out (their contents may be set up here)."""

    def _on_invalidate(self, index: int) -> None:
        """A slot's owner was cleared (its contents may be reset here)."""

    def _on_free(self, index: int) -> None:
        """A slot is back on the free list."""

    # ---- I1: the use check -------------------------------------------------------------------

    def check_current(self, h: SlotHandle, action: str = "read") -> None:
        """Raise `IsolationViolation` unless `h` is still its owner's slot at its generation."""
        if not 0 <= h.index < self.num_slots:
            raise IsolationViolation(
                f"{action} of a page outside the pool",
                page=h.index,
                expected=f"< {self.num_slots}",
                found=str(h.index),
            )
        owner, gen, state = (
            int(self.owner[h.index]),
            int(self.generation[h.index]),
            int(self.state[h.index]),
        )
        if state != SlotState.USED or owner != h.owner or gen != h.generation:
            raise IsolationViolation(
                f"{action} with a stale handle",
                page=h.index,
                expected=f"{self.label(h.owner)} gen {h.generation} used",
                found=f"{self.label(owner)} gen {gen} {SlotState(state).name.lower()}",
            )

    # ---- integrity ---------------------------------------------------------------------------

    def check_integrity(self, outstanding: Iterable[SlotHandle] = ()) -> None:
        """Assert the ledger is consistent at a quiescent point; raise AssertionError naming the fault.

        free + used + pending = total; the free list has each free slot once and
        no other; no free slot has an owner; every used slot has one; no free
        slot may still be written (I7); every handle still held by someone
        (`outstanding`) is current.
        """
        free_list = list(self.free_slots)
        if len(set(free_list)) != len(free_list):
            raise AssertionError("free list holds a page twice")
        free, used = self._indices(SlotState.FREE), self._indices(SlotState.USED)
        total = len(free) + len(used) + self.num_pending
        if total != self.num_slots:
            raise AssertionError(f"free {len(free)} + used + pending = {total} != {self.num_slots}")
        if set(free_list) != set(free):
            raise AssertionError("free list and page states disagree")
        free_owned = [
            i for i, o in zip(free, self._values(self.owner, free), strict=True) if o != FREE_OWNER
        ]
        if free_owned:
            raise AssertionError(f"pages {free_owned[:8]} are free but still owned")
        used_unowned = [
            i for i, o in zip(used, self._values(self.owner, used), strict=True) if o == FREE_OWNER
        ]
        if used_unowned:
            raise AssertionError(f"pages {used_unowned[:8]} are used but have no owner")
        free_inbound = [i for i, b in zip(free, self._values(self.inbound, free), strict=True) if b]
        if free_inbound:  # I7: a late write may still land in a slot anyone can now allocate
            raise AssertionError(f"pages {free_inbound[:8]} are free while a transfer may land")
        for h in outstanding:
            try:
                self.check_current(h, "outstanding handle")
            except IsolationViolation as e:
                raise AssertionError(str(e)) from None

    # Column queries; `KVPool` answers them with one tensor operation each.

    def _indices(self, state: SlotState) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == state]

    def _values(self, column: Column, indices: list[int]) -> list[Any]:
        return [column[i] for i in indices]
