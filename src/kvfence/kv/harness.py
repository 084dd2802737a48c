"""A hypothesis state machine that asks any slot pool the seed's three questions.

1. **Does the pool cover the largest accepted request?** With every slot
   free, a reservation of `largest_request` slots must succeed.
2. **Does a rejected reservation end before it allocates?** A reservation
   that does not fit is refused whole: nothing allocated, nothing any
   holder had is changed.
3. **Does the reader verify what it got?** A live handle reads back exactly
   what its holder wrote; a fresh slot shows no earlier holder's value; a
   handle kept past its release is refused loudly (`stale_error`), never
   answered with whatever the slot holds now.

Point it at your own pool with a small adapter (`PoolUnderTest`), then::

    from kvfence.kv.harness import check_pool
    check_pool(lambda: MyPoolUnderTest(capacity=8), largest_request=8)

`check_pool` raises `PoolUnsafe` with hypothesis's shrunk, minimal failing
sequence of steps when any answer is wrong. Owners come from a small reused
set, so an owner re-borrowing a slot it held before is common: only a
generation stamp tells those two grants apart. `SlotPoolUnderTest` and
`KVPoolUnderTest` adapt this package's pools.

Needs hypothesis: `pip install 'kvfence[harness]'` (it is also in `dev`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

try:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.reporting import with_reporter
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        invariant,
        precondition,
        rule,
        run_state_machine_as_test,
    )
except ModuleNotFoundError as e:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        "kvfence.kv.harness needs hypothesis: pip install 'kvfence[harness]'"
    ) from e

from kvfence.kv.ledger import FREE_OWNER, IsolationViolation, SlotHandle
from kvfence.kv.pool import BatchPages, KVPool
from kvfence.kv.slots import SlotPool

OWNERS = 3  # a small reused set: the same owner re-borrowing a slot is common


class PoolUnderTest(Protocol):
    """What the harness drives; handles are opaque to it except for `index`."""

    @property
    def capacity(self) -> int:
        """Slots in the pool."""

    def register_owner(self, label: str) -> int: ...

    def allocate(self, owner: int, n: int) -> Sequence[Any] | None:
        """All `n` slots for `owner`, or None when refused (then nothing was allocated)."""

    def release(self, handles: Sequence[Any]) -> None: ...

    def put(self, handle: Any, value: int) -> None:
        """Store `value` in the handle's slot, through the pool's checked path."""

    def take(self, handle: Any) -> int | None:
        """The value in the slot (None: nothing written since it was granted);
        raises the pool's stale-handle error when the handle is no longer current."""

    def index(self, handle: Any) -> int:
        """The physical slot a handle names."""

    def check(self, outstanding: Sequence[Any]) -> None:
        """Raise AssertionError when the pool's own bookkeeping is inconsistent (or do nothing)."""


class PoolUnsafe(AssertionError):
    """The pool answered one of the three questions wrong; `steps` is the minimal sequence."""

    def __init__(self, steps: str, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}\nminimal failing sequence:\n{steps}")
        self.steps = steps
        self.cause = cause


@dataclass(eq=False)
class _Lease:
    owner: int
    handles: list[Any]
    values: list[int]
    live: bool = True


@dataclass
class _Config:
    make_pool: Callable[[], PoolUnderTest]
    largest_request: int
    stale_error: type[BaseException]


class PoolMachine(RuleBasedStateMachine):
    """The three questions as rules; `pool_machine` binds it to one pool factory."""

    config: ClassVar[_Config]

    def __init__(self) -> None:
        super().__init__()
        self.pool = self.config.make_pool()
        self.owners = [self.pool.register_owner(f"owner-{i}") for i in range(OWNERS)]
        self.leases: list[_Lease] = []
        self.serial = 0

    @property
    def free(self) -> int:
        used = sum(len(x.handles) for x in self.leases if x.live)
        return self.pool.capacity - used

    def live(self) -> list[_Lease]:
        return [x for x in self.leases if x.live and x.handles]

    def dead(self) -> list[_Lease]:
        return [x for x in self.leases if not x.live and x.handles]

    @rule(who=st.integers(0, OWNERS - 1), size=st.integers(0, 1000))
    def reserve(self, who: int, size: int) -> None:
        """Questions 2 and 3: refused whole when it does not fit; fresh slots hold nothing."""
        n = size % (self.config.largest_request + 2)  # 0 .. largest + 1
        fits = n <= self.free
        got = self.pool.allocate(self.owners[who], n)
        if got is None:
            assert not fits, f"refused {n} slots with {self.free} free"
            return  # nothing changed: the invariant re-reads every live lease
        assert fits, f"granted {n} slots with only {self.free} free"
        handles = list(got)
        assert len(handles) == n, f"asked for {n} slots, got {len(handles)}"
        held = {self.pool.index(h) for x in self.live() for h in x.handles}
        mine = [self.pool.index(h) for h in handles]
        assert len(set(mine)) == n and not held & set(mine), "a slot granted twice"
        for h in handles:
            seen = self.pool.take(h)
            assert seen is None, f"a fresh slot showed an earlier holder's value {seen}"
        values = [self._put(h) for h in handles]
        self.leases.append(_Lease(self.owners[who], handles, values))

    def _put(self, handle: Any) -> int:
        self.serial += 1
        self.pool.put(handle, self.serial)
        return self.serial

    @precondition(lambda self: bool(self.live()))
    @rule(i=st.integers(0, 1000))
    def release(self, i: int) -> None:
        lease = self.live()[i % len(self.live())]
        self.pool.release(lease.handles)
        lease.live = False

    @precondition(lambda self: bool(self.dead()))
    @rule(i=st.integers(0, 1000), j=st.integers(0, 1000))
    def read_stale(self, i: int, j: int) -> None:
        """Question 3: a released handle is refused, whoever holds the slot now."""
        lease = self.dead()[i % len(self.dead())]
        handle = lease.handles[j % len(lease.handles)]
        try:
            value = self.pool.take(handle)
        except self.config.stale_error:
            return
        raise AssertionError(f"a released handle still read the slot (value {value})")

    @precondition(lambda self: not self.live())
    @rule(who=st.integers(0, OWNERS - 1))
    def largest_fits(self, who: int) -> None:
        """Question 1: with every slot free, the largest accepted request is granted."""
        got = self.pool.allocate(self.owners[who], self.config.largest_request)
        assert got is not None, (
            f"the largest accepted request ({self.config.largest_request} slots) does not fit "
            f"an empty pool of {self.pool.capacity}"
        )
        self.leases.append(_Lease(self.owners[who], list(got), [0] * len(got), live=False))
        self.pool.release(list(got))

    @invariant()
    def holders_read_their_own(self) -> None:
        live = self.live()
        for lease in live:
            for h, value in zip(lease.handles, lease.values, strict=True):
                got = self.pool.take(h)
                assert got == value, f"slot {self.pool.index(h)} holds {got}, wrote {value}"
        self.pool.check([h for x in live for h in x.handles])


def pool_machine(config: _Config) -> type[PoolMachine]:
    """The state machine class for one pool factory (a fresh pool per example)."""
    return type("PoolMachine", (PoolMachine,), {"config": config})


def check_pool(
    make_pool: Callable[[], PoolUnderTest],
    *,
    largest_request: int,
    stale_error: type[BaseException] = IsolationViolation,
    max_examples: int = 100,
    steps: int = 30,
    seed: int | None = 0,
) -> None:
    """Run the three questions against pools from `make_pool`; raise `PoolUnsafe` on a wrong answer."""
    machine = pool_machine(_Config(make_pool, largest_request, stale_error))
    report: list[str] = []

    def collect(line: object) -> None:
        report.append(str(line))

    kwargs: dict[str, Any] = {"derandomize": True} if seed is not None else {}
    config = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        **kwargs,
    )
    try:
        with with_reporter(collect):
            run_state_machine_as_test(machine, settings=config)
    except Exception as e:
        raise PoolUnsafe(_steps(report, e), e) from e


def _steps(report: list[str], error: BaseException) -> str:
    """The shrunk steps hypothesis reports (invariant checks and teardown left out)."""
    lines = "\n".join([*report, *getattr(error, "__notes__", [])]).splitlines()
    noise = ("state.holders_read_their_own()", "state.teardown()")
    return "\n".join(x for x in lines if x.startswith("state") and x not in noise)


# ---- adapters for this package's pools --------------------------------------------------------


@dataclass
class SlotPoolUnderTest:
    """A `SlotPool` of dicts; the value lives under "value" and `reset` clears it."""

    capacity: int
    pool: SlotPool[dict[str, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.pool = SlotPool(self.capacity, make=dict, reset=dict.clear)

    def register_owner(self, label: str) -> int:
        return self.pool.register_owner(label)

    def allocate(self, owner: int, n: int) -> list[SlotHandle] | None:
        return self.pool.try_allocate(owner, n)

    def release(self, handles: Sequence[SlotHandle]) -> None:
        self.pool.release(handles)

    def put(self, handle: SlotHandle, value: int) -> None:
        self.pool.get(handle)["value"] = value

    def take(self, handle: SlotHandle) -> int | None:
        return self.pool.get(handle).get("value")

    def index(self, handle: SlotHandle) -> int:
        return handle.index

    def check(self, outstanding: Sequence[SlotHandle]) -> None:
        self.pool.check_integrity(outstanding)


@dataclass
class KVPoolUnderTest:
    """A `KVPool` whose pages hold the value in every K slot; reads go through `verify` (I1)."""

    pool: KVPool

    @property
    def capacity(self) -> int:
        return self.pool.num_pages

    def register_owner(self, label: str) -> int:
        return self.pool.register_owner(label)

    def allocate(self, owner: int, n: int) -> list[SlotHandle] | None:
        return self.pool.allocate(owner, n) if self.pool.can_allocate(n) else None

    def release(self, handles: Sequence[SlotHandle]) -> None:
        self.pool.release(handles)

    def put(self, handle: SlotHandle, value: int) -> None:
        self.pool.check_current(handle, "write")
        self.pool.k[:, handle.index] = float(value)
        self.pool.mark_written(torch.tensor([handle.index]), torch.tensor([self.pool.page_size]))

    def take(self, handle: SlotHandle) -> int | None:
        self.pool.check_current(handle, "read")
        if int(self.pool.written[handle.index]) == 0:
            return None  # granted, nothing written yet: there is nothing to read
        batch = BatchPages.build([[handle]], [handle.owner], [FREE_OWNER], [self.pool.page_size])
        self.pool.verify(batch)  # the engine's own read check, positions included
        return int(self.pool.k[0, handle.index].flatten()[0])

    def index(self, handle: SlotHandle) -> int:
        return handle.index

    def check(self, outstanding: Sequence[SlotHandle]) -> None:
        self.pool.check_integrity(outstanding)
