"""Stateful property tests: random interleavings over the pool ledger and the request lifecycle.

A model beside the pool records the ground truth: which lease (one
allocation) holds each page, what it wrote there (each lease writes its own
serial number into the K bytes), which transfers may still land, and which
pages wait for one. Owners come from a small reused set of namespaces, so a
namespace re-acquiring a page it held before is common and only the
generation tells the two grants apart.

Asserted after every step: I1 (verify raises iff the model says the read is
not legitimate, and a legitimate read returns the reader's own bytes), I5
(release clears the owner and bumps the generation), I7 (no page with a
transfer in flight is handed out), I2/I6 (terminal states distinct, exactly
one per request, a second one raises and changes nothing) and
`check_integrity()`.

The same machine runs with each fault switch that removes a defence, and
must then find the violation: the tests can fail.

Depth: a CI run takes at least `PROPERTY_STEPS` steps (10^5 by default, about
45 s of one core); `KVFENCE_PROPERTY_STEPS=1000000` is the longer profile for
runs outside CI. The fault runs use the same examples, at the same depth.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import TypeVar

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvfence.engine.request import IllegalTransition, Request, RequestError, RequestState
from kvfence.faults import Fault, FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import (
    FREE_OWNER,
    BatchPages,
    IsolationViolation,
    KVPool,
    PageHandle,
    PageState,
    PoolExhausted,
)

GEOM = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, page_size=4, dtype="float32")
PAGE = GEOM.page_size
NUM_PAGES = 6
NUM_NAMESPACES = 3

S = RequestState
# The PD path, restated here as the spec the transition table must match.
LIVE_MOVES: dict[RequestState, set[RequestState]] = {
    S.WAITING: {S.BOOTSTRAPPING, S.PREFILLING},
    S.BOOTSTRAPPING: {S.PREFILLING, S.TRANSFERRING},
    S.PREFILLING: {S.TRANSFERRING, S.DECODING},
    S.TRANSFERRING: {S.DECODING},
    S.DECODING: set(),
}
CAN_REJECT = {S.WAITING, S.BOOTSTRAPPING, S.PREFILLING}  # rejection happens at admission or before
CAN_FINISH = {S.TRANSFERRING, S.DECODING}
ERROR_STATES = {S.REJECTED, S.ABORTED, S.FAILED}
TERMINAL_STATES = ERROR_STATES | {S.FINISHED}
T = TypeVar("T")


@dataclass(eq=False)
class Lease:
    """One allocation: its handles and the serial it writes as content."""

    serial: int
    owner: int
    handles: list[PageHandle]
    live: bool = True


@dataclass(eq=False)
class Transfer:
    lease: Lease
    pages: list[int]
    landed: bool = False


@dataclass(eq=False)
class TrackedRequest:
    req: Request
    namespace: int
    prompt: tuple[int, ...]
    lease: Lease | None = None
    error: RequestError | None = None


@dataclass(frozen=True)
class Row:
    prefix: Lease | None
    own: Lease
    reader: int
    namespace: int
    length: int

    @property
    def table(self) -> list[tuple[Lease, PageHandle]]:
        shared = [(self.prefix, h) for h in self.prefix.handles] if self.prefix else []
        return shared + [(self.own, h) for h in self.own.handles]


PICK = st.integers(0, 63)
# A read row: (own lease, prefix lease or none, reader, namespace, length), as small integers
# that shrink towards "the newest lease, read by its owner".
ROW = st.tuples(PICK, PICK, st.integers(0, NUM_NAMESPACES), st.integers(0, 5), st.integers(0, 255))


def pick(items: list[T], i: int) -> T:
    """The i-th newest item (cyclic), so draws stay valid as the lists change."""
    return items[-1 - i % len(items)]


class IsolationMachine(RuleBasedStateMachine):
    """Pool + requests under random interleavings; see the module docstring."""

    faults: FaultSet = FaultSet()
    # False: judge only by reads (I1 and contents), never by ledger bookkeeping,
    # to show a missing defence surfaces as a leak, not just as a bad counter.
    check_ledger: bool = True
    stats: Counter[str] | None = None  # what the runs exercised, summed over examples

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVPool(GEOM, NUM_PAGES, faults=self.faults)
        self.owners = [self.pool.register_owner(f"ns{i}") for i in range(NUM_NAMESPACES)]
        self.leases: list[Lease] = []
        self.holder: dict[int, Lease] = {}  # page -> live lease holding it
        self.written: dict[int, int] = {}  # page -> slots written under its current holder
        self.pending: set[int] = set()  # released, waiting for a transfer to end (I7)
        self.inflight: dict[int, Transfer] = {}  # page -> transfer that may still land
        self.transfers: list[Transfer] = []
        self.requests: list[TrackedRequest] = []
        self.serial = 0
        self.steps = 0
        self.seen: Counter[str] = Counter()

    # ---- model helpers ----------------------------------------------------------------------

    def model_free(self) -> int:
        return NUM_PAGES - len(self.holder) - len(self.pending)

    def live_leases(self) -> list[Lease]:
        return [lease for lease in self.leases if lease.live]

    def do_allocate(self, owner: int, n: int) -> Lease | None:
        free_before = self.pool.num_free
        expect_room = n <= self.model_free()
        try:
            handles = self.pool.allocate(owner, n)
        except PoolExhausted:
            self.seen["allocation refused: exhausted"] += 1
            if self.check_ledger:
                assert not expect_room, f"ledger: PoolExhausted for {n} pages with room"
                assert self.pool.num_free == free_before, "ledger: failed allocation took pages"
            return None
        if self.check_ledger:
            assert expect_room, f"ledger: allocated {n} pages, model has {self.model_free()} free"
        self.serial += 1
        lease = Lease(self.serial, owner, handles)
        for h in handles:
            if self.check_ledger:
                assert h.index not in self.inflight, f"I7: page {h.index} handed out mid-transfer"
                assert h.index not in self.holder, f"ledger: page {h.index} handed out twice"
                assert h.owner == owner
                assert h.generation == int(self.pool.generation[h.index])
            self.pending.discard(h.index)
            self.holder[h.index] = lease
            self.written[h.index] = 0
        self.leases.append(lease)
        return lease

    def do_release(self, lease: Lease) -> None:
        try:
            self.pool.release(lease.handles)
        except IsolationViolation as e:
            raise AssertionError(f"I5: release of a current lease refused: {e}") from None
        lease.live = False
        for h in lease.handles:
            if self.holder.get(h.index) is lease:
                del self.holder[h.index]
            if h.index in self.inflight:
                self.pending.add(h.index)
                self.seen["release deferred: transfer in flight"] += 1
            if not self.check_ledger:
                continue
            assert int(self.pool.owner[h.index]) == FREE_OWNER, f"I5: page {h.index} kept its owner"
            assert int(self.pool.generation[h.index]) == h.generation + 1, (
                f"I5: page {h.index} generation not bumped on release"
            )
            if h.index in self.inflight:
                assert int(self.pool.state[h.index]) == PageState.PENDING_RELEASE, (
                    f"I7: page {h.index} freed while a transfer may still land"
                )

    def legit_slots(self, row: Row) -> list[bool]:
        out = []
        for k, (lease, h) in enumerate(row.table):
            needed = max(0, min(PAGE, row.length - k * PAGE))
            out.append(
                lease.live
                and self.holder.get(h.index) is lease
                and h.owner in (row.reader, row.namespace)
                and self.written[h.index] >= needed
            )
        return out

    # ---- pool rules -------------------------------------------------------------------------

    @rule(ns=st.integers(0, NUM_NAMESPACES - 1), n=st.integers(0, 3))
    def allocate(self, ns: int, n: int) -> None:
        self.do_allocate(self.owners[ns], n)

    @precondition(lambda self: any(lease.handles for lease in self.live_leases()))
    @rule(i=PICK, j=PICK, upto=st.integers(1, PAGE))
    def write(self, i: int, j: int, upto: int) -> None:
        """A forward step writes slots [0, upto) of one page and records them (mark_written)."""
        lease = pick([x for x in self.live_leases() if x.handles], i)
        h = pick(lease.handles, j)
        self.pool.k[:, h.index, :upto] = float(lease.serial)
        self.pool.mark_written(torch.tensor([h.index]), torch.tensor([upto]))
        self.written[h.index] = max(self.written[h.index], upto)

    @precondition(lambda self: bool(self.leases))
    @rule(draws=st.lists(ROW, min_size=1, max_size=3))
    def read(self, draws: list[tuple[int, int, int, int, int]]) -> None:
        """I1: verify raises iff some row is not legitimate; legitimate rows read their own bytes."""
        rows = [self.make_row(*d) for d in draws]
        batch = BatchPages.build(
            [[h for _, h in r.table] for r in rows],
            [r.reader for r in rows],
            [r.namespace for r in rows],
            [r.length for r in rows],
        )
        slots = [self.legit_slots(r) for r in rows]
        beyond = [r.length > len(r.table) * PAGE for r in rows]
        legit = all(all(s) for s in slots) and not any(beyond)
        try:
            self.pool.verify(batch)
        except IsolationViolation as e:
            assert not legit, f"I1: verify refused a legitimate read: {e}"
            self.seen["read refused"] += 1
            assert e.page == self.expected_page(rows, slots, beyond), f"I1: wrong page named: {e}"
            return
        assert legit, f"I1: verify allowed a read the ledger forbids: {rows}"
        self.seen["read allowed"] += 1
        if any(r.prefix for r in rows):
            self.seen["read allowed: shared prefix page"] += 1
        for r in rows:
            self.assert_contents(r)

    def make_row(self, i: int, j: int, who: int, ns: int, at: int) -> Row:
        own = pick(self.leases, i)
        prefix = None if j % 2 == 0 else pick(self.leases, j // 2)
        # Mostly the rightful reader and namespace, sometimes anyone: both sides of I1.
        reader = own.owner if who == 0 else self.owners[who - 1]
        if ns == 0:
            namespace = FREE_OWNER
        elif ns <= NUM_NAMESPACES:
            namespace = self.owners[ns - 1]
        else:
            namespace = prefix.owner if prefix else FREE_OWNER
        pages = len(own.handles) + (len(prefix.handles) if prefix else 0)
        return Row(prefix, own, reader, namespace, at % (pages * PAGE + 2))

    def expected_page(self, rows: list[Row], slots: list[list[bool]], beyond: list[bool]) -> int:
        for r, s in zip(rows, slots, strict=True):
            for (_, h), ok in zip(r.table, s, strict=True):
                if not ok:
                    return h.index
        r = rows[beyond.index(True)]
        return r.table[-1][1].index if r.table else -1

    def assert_contents(self, row: Row) -> None:
        for k, (lease, h) in enumerate(row.table):
            needed = max(0, min(PAGE, row.length - k * PAGE))
            got = self.pool.k[0, h.index, :needed, 0, 0]
            leaked = sorted({int(x) for x in got.tolist()} - {lease.serial})
            assert not leaked, (
                f"I1: lease {lease.serial} read page {h.index} and got bytes written by "
                f"lease(s) {leaked}"
            )

    @precondition(lambda self: bool(self.unbound_leases()))
    @rule(i=PICK)
    def release(self, i: int) -> None:
        """Free a lease no request holds (a request's pages go when it ends)."""
        self.do_release(pick(self.unbound_leases(), i))

    def unbound_leases(self) -> list[Lease]:
        bound = {id(t.lease) for t in self.requests}
        return [x for x in self.live_leases() if id(x) not in bound]

    @precondition(lambda self: self.check_ledger and bool(self.dead_leases()))
    @rule(i=PICK)
    def release_stale(self, i: int) -> None:
        """Double free / stale handle: must raise (I5) and change nothing."""
        lease = pick(self.dead_leases(), i)
        free, gens = self.pool.num_free, self.pool.generation.clone()
        try:
            self.pool.release(lease.handles)
        except IsolationViolation:
            self.seen["stale release refused"] += 1
            assert self.pool.num_free == free and torch.equal(self.pool.generation, gens)
            return
        raise AssertionError(f"I5: release of stale lease {lease.serial} accepted")

    def dead_leases(self) -> list[Lease]:
        return [x for x in self.leases if not x.live and x.handles]

    @precondition(lambda self: bool(self.transfer_candidates()))
    @rule(i=PICK)
    def begin_transfer(self, i: int) -> None:
        lease = pick(self.transfer_candidates(), i)
        self.pool.begin_inbound(lease.handles)
        transfer = Transfer(lease, [h.index for h in lease.handles])
        self.transfers.append(transfer)
        for i in transfer.pages:
            self.inflight[i] = transfer

    def transfer_candidates(self) -> list[Lease]:
        return [
            x
            for x in self.live_leases()
            if x.handles and not any(h.index in self.inflight for h in x.handles)
        ]

    @precondition(lambda self: any(not t.landed for t in self.transfers))
    @rule(i=PICK)
    def transfer_lands(self, i: int) -> None:
        """The RDMA write arrives, before its confirmation."""
        self.land(pick([t for t in self.transfers if not t.landed], i))

    def land(self, transfer: Transfer) -> None:
        """Bytes land whatever the ledger says; only a live lease records them as written."""
        transfer.landed = True
        self.pool.k[:, torch.tensor(transfer.pages)] = float(transfer.lease.serial)
        live = [p for p in transfer.pages if self.holder.get(p) is transfer.lease]
        if live:
            self.pool.mark_written(torch.tensor(live), torch.full((len(live),), PAGE))
            for p in live:
                self.written[p] = PAGE

    @precondition(lambda self: bool(self.transfers))
    @rule(i=PICK, complete=st.booleans())
    def transfer_ends(self, i: int, complete: bool) -> None:
        """Completion (the bytes have landed) or cancellation: deferred releases happen now (I7)."""
        transfer = pick(self.transfers, i)
        if complete and not transfer.landed:
            self.land(transfer)
        self.transfers.remove(transfer)
        self.pool.end_inbound(transfer.pages)
        for p in transfer.pages:
            if self.inflight.get(p) is transfer:
                del self.inflight[p]
            self.pending.discard(p)

    # ---- request rules (I2, I6) -------------------------------------------------------------

    @rule(ns=st.integers(0, NUM_NAMESPACES - 1), n=st.integers(1, 6))
    def new_request(self, ns: int, n: int) -> None:
        prompt = tuple(range(1, n + 1))
        rid = f"r{len(self.requests)}"
        req = Request(rid=rid, tenant=f"ns{ns}", prompt_ids=prompt, max_tokens=4)
        self.requests.append(TrackedRequest(req, self.owners[ns], prompt))

    @precondition(lambda self: bool(self.reservable()))
    @rule(i=PICK)
    def reserve(self, i: int) -> None:
        """Bootstrap: reserve pages for the whole prompt in the request's namespace."""
        t = pick(self.reservable(), i)
        t.lease = self.do_allocate(t.namespace, GEOM.pages_for(len(t.prompt)))

    def reservable(self) -> list[TrackedRequest]:
        return [x for x in self.requests if x.lease is None and not x.req.terminal]

    @precondition(lambda self: bool(self.requests))
    @rule(i=PICK, to=st.sampled_from(list(RequestState)))
    def advance(self, i: int, to: RequestState) -> None:
        t = pick(self.requests, i)
        before = t.req.state
        allowed = to in LIVE_MOVES.get(before, set())
        if to is S.FINISHED:  # prefill's part done: no reason yet, no error
            allowed = self.may_end(before, to)
        # Error endings only through reject/abort/fail: a bare advance raises (I6).
        self.attempt(t, allowed, lambda: t.req.advance(to))
        if allowed:
            assert t.req.state is to
            if to in TERMINAL_STATES:
                self.end_request(t)

    @precondition(lambda self: bool(self.requests))
    @rule(
        i=PICK,
        outcome=st.sampled_from([S.FINISHED, S.REJECTED, S.ABORTED, S.FAILED]),
        status=st.sampled_from([400, 408, 499, 500, 503]),
    )
    def end(self, i: int, outcome: RequestState, status: int) -> None:
        """finish / reject / abort / fail: exactly one terminal outcome (I6), original error kept."""
        t = pick(self.requests, i)
        error = RequestError(status, "invalid_request_error", f"{outcome.value} #{self.steps}")
        allowed = self.may_end(t.req.state, outcome)
        act = {
            S.FINISHED: lambda: t.req.finish("stop"),
            S.REJECTED: lambda: t.req.reject(error),
            S.ABORTED: lambda: t.req.abort(error),
            S.FAILED: lambda: t.req.fail(error),
        }[outcome]
        self.attempt(t, allowed, act)
        if allowed:
            t.error = None if outcome is S.FINISHED else error
            assert t.req.state is outcome
            assert t.req.error is t.error, "I6: the original error object must reach the end"
            self.end_request(t)

    @staticmethod
    def may_end(state: RequestState, outcome: RequestState) -> bool:
        if state in TERMINAL_STATES:
            return False
        if outcome is S.REJECTED:
            return state in CAN_REJECT
        if outcome is S.FINISHED:
            return state in CAN_FINISH
        return True

    def attempt(self, t: TrackedRequest, allowed: bool, act: object) -> None:
        snapshot = (t.req.state, t.req.error, t.req.finish_reason, len(t.req.history))
        try:
            act()  # type: ignore[operator]
        except IllegalTransition:
            self.seen["illegal transition refused"] += 1
            assert not allowed, f"I2: legal move refused from {snapshot[0]}"
            after = (t.req.state, t.req.error, t.req.finish_reason, len(t.req.history))
            assert after == snapshot, "I6: a refused transition changed the request"
            return
        assert allowed, f"I2/I6: illegal move accepted from {snapshot[0]} to {t.req.state}"

    def end_request(self, t: TrackedRequest) -> None:
        """A terminal request gives its pages back (deferred while a transfer may land, I7)."""
        self.seen["request ended"] += 1
        if t.lease is not None and t.lease.live:
            self.do_release(t.lease)

    # ---- invariants after every step ------------------------------------------------------

    @invariant()
    def ledger_is_consistent(self) -> None:
        self.steps += 1
        if not self.check_ledger:
            return
        outstanding = [h for lease in self.live_leases() for h in lease.handles]
        try:
            self.pool.check_integrity(outstanding)
        except AssertionError as e:
            raise AssertionError(f"integrity: {e}") from None
        assert self.pool.num_free == self.model_free(), "ledger: free count diverged"
        assert self.pool.num_pending == len(self.pending), "I7: pending count diverged"

    @invariant()
    def requests_end_once_and_honestly(self) -> None:
        for t in self.requests:
            req = t.req
            ends = [s for s in req.history if s in TERMINAL_STATES]
            assert len(ends) <= 1, f"I6: {req.rid} ended {len(ends)} times"
            assert req.terminal is (req.state in TERMINAL_STATES), "I2: terminal flag drifted"
            if ends:
                assert req.history[-1] is ends[0], "I6: a request moved after its end"
            assert (req.error is not None) is (req.state in ERROR_STATES), (
                f"I2/I6: {req.rid} in {req.state.value} with error {req.error}"
            )
            assert req.finish_reason is None or req.state is S.FINISHED, (
                "I2: only FINISHED carries a finish reason"
            )
            assert req.prompt_ids == t.prompt, "I2: the prompt was rewritten"
            assert req.to_finish is None, "I2: the legacy side field was written"
            if req.terminal and t.lease is not None:
                assert not t.lease.live, f"I7: ended request {req.rid} still holds pages"

    def teardown(self) -> None:
        self.seen["step"] += self.steps
        if self.stats is not None:
            self.stats.update(self.seen)


CI = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# Steps per CI run; the longer profile sets KVFENCE_PROPERTY_STEPS. A run of 100-step
# examples averages ~88 steps (hypothesis ends some early), so 80 per example is budgeted.
PROPERTY_STEPS = int(os.environ.get("KVFENCE_PROPERTY_STEPS", "100000"))
STEPS_PER_EXAMPLE = 100
DEEP = settings(
    CI,
    max_examples=math.ceil(PROPERTY_STEPS / 80),
    stateful_step_count=STEPS_PER_EXAMPLE,
)


def machine(
    faults: FaultSet, check_ledger: bool, stats: Counter[str] | None = None
) -> type[IsolationMachine]:
    return type(
        "Machine",
        (IsolationMachine,),
        {"faults": faults, "check_ledger": check_ledger, "stats": stats},
    )


def test_isolation_holds_over_a_hundred_thousand_random_steps() -> None:
    stats: Counter[str] = Counter()
    run_state_machine_as_test(machine(FaultSet(), True, stats), settings=DEEP)
    print(f"property steps: {stats['step']} ({DEEP.max_examples} examples)")
    assert stats["step"] >= PROPERTY_STEPS, f"only {stats['step']} of {PROPERTY_STEPS} steps ran"
    # Every path the invariants guard was actually taken, many times.
    for what in (
        "read allowed",
        "read allowed: shared prefix page",
        "read refused",
        "allocation refused: exhausted",
        "release deferred: transfer in flight",
        "stale release refused",
        "illegal transition refused",
        "request ended",
    ):
        assert stats[what] >= PROPERTY_STEPS // 1000, (
            f"the run exercised {what!r} only {stats[what]} times: {stats}"
        )


@pytest.mark.parametrize(
    ("fault", "check_ledger", "finds"),
    [
        (Fault.NO_LEDGER_CHECK, True, r"^I1: verify allowed"),
        (Fault.NO_INVALIDATE, True, r"^I5: page \d+ kept its owner"),
        (Fault.EARLY_FREE, True, r"^I7: page \d+ freed while a transfer may still land"),
    ],
    ids=["no-ledger-check", "no-invalidate", "early-free"],
)
def test_property_finds_the_leak_when_a_defence_is_off(
    fault: Fault, check_ledger: bool, finds: str
) -> None:
    """Each fault switch removes one defence; the same machine must find the violation.

    It runs the deep run's own settings (same examples, same depth): the
    violation is found within them. Shrinking is skipped: the assertion is on
    what was found, and the search is deterministic (derandomized), so this
    is a fixed, fast replay in CI.
    """
    with pytest.raises(AssertionError, match=finds):
        run_state_machine_as_test(
            machine(FaultSet.of(fault), check_ledger),
            settings=settings(
                DEEP,
                report_multiple_bugs=False,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
            ),
        )


@pytest.mark.parametrize(
    "fault", [FaultSet(), FaultSet.of(Fault.EARLY_FREE)], ids=["fixed", "early-free"]
)
def test_late_transfer_leaks_into_the_next_owner_only_without_deferred_release(
    fault: FaultSet,
) -> None:
    """The machine's own steps, replayed: a transfer into a released page lands after reuse.

    Judged by contents alone (no ledger bookkeeping): with I7 the late bytes
    land in a page nobody can hold yet; without it they overwrite the next
    owner's KV, which a legitimate read then returns.
    """
    m = machine(fault, False)()
    m.allocate(ns=0, n=1)
    m.begin_transfer(i=0)
    m.release(i=0)
    m.allocate(ns=1, n=1)
    m.write(i=0, j=0, upto=2)
    m.transfer_ends(i=0, complete=True)
    if fault:
        with pytest.raises(
            AssertionError,
            match=r"^I1: lease 2 read page \d+ and got bytes written by lease\(s\) \[1\]",
        ):
            m.read(draws=[(0, 0, 0, 0, 2)])
    else:
        m.read(draws=[(0, 0, 0, 0, 2)])
        m.ledger_is_consistent()


@pytest.mark.parametrize(
    "fault", [FaultSet(), FaultSet.of(Fault.NO_INVALIDATE)], ids=["fixed", "no-invalidate"]
)
def test_stale_handle_reads_the_namespaces_next_grant_only_without_invalidation(
    fault: FaultSet,
) -> None:
    """The machine's own steps, replayed: a namespace re-acquires the page it released.

    Judged by reads alone: with I5 the old handle's generation is stale and
    verify refuses it; without it the old handle passes verify and reads the
    new grant's bytes.
    """
    m = machine(fault, False)()
    m.allocate(ns=0, n=1)
    m.release(i=0)
    m.allocate(ns=0, n=1)  # LIFO: the same physical page, same namespace
    m.write(i=0, j=0, upto=2)
    m.read(draws=[(0, 0, 0, 0, 2)])  # the new grant reads its own bytes
    if fault:
        with pytest.raises(AssertionError, match=r"^I1: verify allowed a read the ledger forbids"):
            m.read(draws=[(1, 0, 0, 0, 2)])
    else:
        m.read(draws=[(1, 0, 0, 0, 2)])  # refused by verify, as the model expects
        m.ledger_is_consistent()
