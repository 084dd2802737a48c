"""`SlotPool`: the ownership ledger over plain Python objects (no tensors, no model).

A fixed pool of reusable objects (session slots, player-state buffers,
connection buffers) that requests borrow, guarded the way `KVPool` guards KV
pages (INCIDENT.md, "The general pattern"):

* `allocate(owner, n)` gives all `n` slots or raises `PoolExhausted` with
  nothing allocated (`try_allocate` returns None instead);
* `release(handles)` resets each object (`reset`) and invalidates the slot:
  owner cleared, generation bumped (I5);
* `get(handle)` verifies owner and generation before it returns the object,
  so a handle kept past its release raises `IsolationViolation` instead of
  handing out the next user's data (I1);
* `check_integrity(outstanding)` asserts the ledger is consistent.

Example::

    from kvfence.kv.slots import SlotPool

    pool = SlotPool(4, make=dict, reset=dict.clear)
    alice = pool.register_owner("alice")
    (slot,) = pool.allocate(alice, 1)
    pool.get(slot)["score"] = 10
    pool.release([slot])
    pool.get(slot)  # IsolationViolation: a stale handle fails loudly

`kvfence.kv.harness` tests a pool like this one (or your own) against the
seed's three questions with a hypothesis state machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from kvfence.faults import FaultSet
from kvfence.kv.ledger import OwnershipLedger, SlotHandle

T = TypeVar("T")


class SlotPool(OwnershipLedger, Generic[T]):
    """`num_slots` objects made by `make()`, each reset by `reset(obj)` when released."""

    what = "slot pool"
    unit = "slots"

    def __init__(
        self,
        num_slots: int,
        *,
        make: Callable[[], T],
        reset: Callable[[T], object],
        faults: FaultSet | None = None,
    ) -> None:
        super().__init__(num_slots, faults=faults)
        self._objects = [make() for _ in range(num_slots)]
        self._reset = reset

    def try_allocate(self, owner: int, n: int) -> list[SlotHandle] | None:
        """All `n` slots, or None with nothing allocated (the reservation ends here)."""
        return self.allocate(owner, n) if self.can_allocate(n) else None

    def get(self, handle: SlotHandle) -> T:
        """The slot's object, only for the owner and generation the handle was granted (I1)."""
        self.check_current(handle, "read")
        return self._objects[handle.index]

    def _on_invalidate(self, index: int) -> None:
        self._reset(self._objects[index])  # I5: the next owner never sees this one's state
