"""A game backend's session slots: a fixed pool of player-state objects, borrowed per match.

The incident's bug, outside LLM serving: a match reserves slots for its
party, a slot is released when a player leaves, and the next match gets it.
`SessionSlots` builds on `kvfence.kv.slots.SlotPool` (release resets the
session and bumps its generation; every read checks owner and generation).
`ReleaseUnsafe` is the article's unsafe pool: release only puts the slot
back on the free list. The harness (`kvfence.kv.harness.check_pool`) asks
both the seed's three questions; the safe one passes, the unsafe one fails
with a minimal sequence of steps.

    python examples/session_slots.py   # prints both verdicts; exit 0 when they are as expected
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfence.kv.harness import PoolUnsafe, check_pool
from kvfence.kv.ledger import IsolationViolation, SlotHandle
from kvfence.kv.slots import SlotPool

MAX_PARTY = 4  # the largest party a match accepts


@dataclass
class Session:
    """One player's state while in a match."""

    player: str = ""
    score: int | None = None
    inventory: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.player, self.score = "", None
        self.inventory.clear()


class SessionSlots:
    """The backend's pool: `capacity` sessions, a match borrows one per player."""

    def __init__(self, capacity: int) -> None:
        self.pool: SlotPool[Session] = SlotPool(capacity, make=Session, reset=Session.reset)

    @property
    def capacity(self) -> int:
        return self.pool.num_slots

    def register_owner(self, label: str) -> int:
        return self.pool.register_owner(label)  # a match (or a lobby) owns its slots

    def allocate(self, owner: int, n: int) -> list[SlotHandle] | None:
        return self.pool.try_allocate(owner, n)  # the whole party or nobody

    def release(self, handles: Sequence[SlotHandle]) -> None:
        self.pool.release(handles)

    def put(self, handle: SlotHandle, value: int) -> None:
        self.pool.get(handle).score = value

    def take(self, handle: SlotHandle) -> int | None:
        return self.pool.get(handle).score

    def index(self, handle: SlotHandle) -> int:
        return handle.index

    def check(self, outstanding: Sequence[SlotHandle]) -> None:
        self.pool.check_integrity(outstanding)


class ReleaseUnsafe:
    """The unsafe pool: no reset, no owner cleared, no generation, no check on read."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.sessions = [Session() for _ in range(capacity)]
        self.free = list(range(capacity))
        self.owners = 0

    def register_owner(self, label: str) -> int:
        self.owners += 1
        return self.owners

    def allocate(self, owner: int, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def release(self, handles: Sequence[int]) -> None:
        self.free.extend(handles)  # ReleaseUnsafe: the session keeps its state

    def put(self, handle: int, value: int) -> None:
        self.sessions[handle].score = value

    def take(self, handle: int) -> int | None:
        return self.sessions[handle].score  # whoever holds the slot now

    def index(self, handle: int) -> int:
        return handle

    def check(self, outstanding: Sequence[int]) -> None:
        return None  # nothing to check: it keeps no ledger


def main() -> int:
    check_pool(lambda: SessionSlots(8), largest_request=MAX_PARTY, stale_error=IsolationViolation)
    print("SessionSlots: the three questions answered right")
    try:
        check_pool(lambda: ReleaseUnsafe(8), largest_request=MAX_PARTY)
    except PoolUnsafe as e:
        print(f"ReleaseUnsafe: unsafe, as expected\n{e}")
        return 0
    print("ReleaseUnsafe: the harness did not find the bug")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
