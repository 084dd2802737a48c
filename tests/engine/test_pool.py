"""KVPool unit tests: allocation, invalidation (I5), deferred release (I7), the read check (I1)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

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
    ScrubPolicy,
)

GEOM = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")
PAGE = GEOM.page_size


def make_pool(num_pages: int = 6, scrub: ScrubPolicy = ScrubPolicy.NONE, *faults: Fault) -> KVPool:
    return KVPool(GEOM, num_pages, scrub=scrub, faults=FaultSet.of(*faults))


def write(pool: KVPool, handles: list[PageHandle], tokens: int, value: float = 1.0) -> None:
    """Fill the first `tokens` slots of a page table with `value` and record them as written."""
    for k, h in enumerate(handles):
        upto = max(0, min(PAGE, tokens - k * PAGE))
        pool.k[:, h.index, :upto] = value
        pool.v[:, h.index, :upto] = value
        pool.mark_written(torch.tensor([h.index]), torch.tensor([upto]))


def read(
    pool: KVPool, handles: list[PageHandle], reader: int, length: int, namespace: int = FREE_OWNER
) -> None:
    pool.verify(BatchPages.build([handles], [reader], [namespace], [length]))


# ---- allocate / release -------------------------------------------------------------------


def test_allocate_gives_distinct_used_pages_owned_by_the_caller() -> None:
    pool = make_pool()
    a = pool.register_owner("req-a")
    handles = pool.allocate(a, 3)
    assert len({h.index for h in handles}) == 3
    assert all(h.owner == a and h.generation == 0 for h in handles)
    idx = torch.tensor([h.index for h in handles])
    assert (pool.state[idx] == PageState.USED).all()
    assert (pool.owner[idx] == a).all()
    assert (pool.num_free, pool.num_used) == (3, 3)
    pool.check_integrity(handles)


def test_exhausted_allocation_is_explicit_and_allocates_nothing() -> None:
    pool = make_pool(num_pages=4)
    a, b = pool.register_owner("a"), pool.register_owner("b")
    held = pool.allocate(a, 3)
    with pytest.raises(PoolExhausted) as info:
        pool.allocate(b, 2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert "requested 2 pages, 1 free" in str(info.value)
    assert pool.num_free == 1
    assert int((pool.owner == b).sum()) == 0
    pool.check_integrity(held)


def test_allocate_rejects_the_free_owner_and_negative_counts() -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="free owner"):
        pool.allocate(FREE_OWNER, 1)
    with pytest.raises(ValueError, match=">= 0"):
        pool.allocate(pool.register_owner("a"), -1)
    assert pool.num_free == 6


def test_release_invalidates_owner_and_bumps_generation() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 2)
    write(pool, handles, 8)
    pool.release(handles)
    for h in handles:
        assert int(pool.owner[h.index]) == FREE_OWNER
        assert int(pool.generation[h.index]) == h.generation + 1
        assert int(pool.written[h.index]) == 0
        assert int(pool.state[h.index]) == PageState.FREE
    assert pool.num_free == 6
    pool.check_integrity()


def test_reallocated_page_carries_the_new_generation() -> None:
    pool = make_pool(num_pages=1)
    ns = pool.register_owner("tenant-prefix")
    first = pool.allocate(ns, 1)
    pool.release(first)
    second = pool.allocate(ns, 1)
    assert second[0].index == first[0].index
    assert second[0].generation == first[0].generation + 1


def test_double_free_raises_and_changes_nothing() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 2)
    pool.release(handles)
    gens = pool.generation.clone()
    with pytest.raises(IsolationViolation, match="stale handle") as info:
        pool.release(handles)
    assert info.value.page == handles[0].index
    assert torch.equal(pool.generation, gens)
    assert pool.num_free == 6
    pool.check_integrity()


def test_release_of_a_stale_handle_after_reuse_raises() -> None:
    pool = make_pool(num_pages=1)
    ns = pool.register_owner("tenant-prefix")
    old = pool.allocate(ns, 1)
    pool.release(old)
    new = pool.allocate(ns, 1)
    with pytest.raises(IsolationViolation) as info:
        pool.release(old)
    assert "gen 0" in info.value.expected and "gen 1" in info.value.found
    pool.check_integrity(new)


def test_release_of_someone_elses_page_raises() -> None:
    pool = make_pool()
    a, b = pool.register_owner("a"), pool.register_owner("b")
    (h,) = pool.allocate(a, 1)
    forged = PageHandle(h.index, h.generation, b)
    with pytest.raises(IsolationViolation, match="stale handle"):
        pool.release([forged])
    pool.check_integrity([h])


def test_release_listing_a_page_twice_raises_before_freeing_anything() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 2)
    with pytest.raises(IsolationViolation, match="twice"):
        pool.release([handles[0], handles[1], handles[0]])
    assert pool.num_used == 2
    pool.check_integrity(handles)


def test_release_of_a_page_outside_the_pool_raises() -> None:
    pool = make_pool()
    with pytest.raises(IsolationViolation, match="outside the pool"):
        pool.release([PageHandle(99, 0, pool.register_owner("a"))])


# ---- scrub policies (I5: invalidation always; zeroing is a policy) -------------------------


@pytest.mark.parametrize(
    ("scrub", "zero_after_release", "zero_after_reallocate"),
    [
        (ScrubPolicy.NONE, False, False),
        (ScrubPolicy.ON_RELEASE, True, True),
        (ScrubPolicy.ON_ALLOCATE, False, True),
    ],
)
def test_scrub_policy_zeroes_exactly_when_it_says(
    scrub: ScrubPolicy, zero_after_release: bool, zero_after_reallocate: bool
) -> None:
    pool = make_pool(1, scrub)
    a, b = pool.register_owner("a"), pool.register_owner("b")
    (h,) = pool.allocate(a, 1)
    write(pool, [h], PAGE, value=7.0)
    pool.release([h])
    assert bool((pool.k[:, h.index] == 0).all()) is zero_after_release
    assert bool((pool.v[:, h.index] == 0).all()) is zero_after_release
    pool.allocate(b, 1)
    assert bool((pool.k[:, h.index] == 0).all()) is zero_after_reallocate
    assert bool((pool.v[:, h.index] == 0).all()) is zero_after_reallocate
    # Whatever the bytes hold, the ledger never lets the new owner read unwritten slots.
    assert int(pool.written[h.index]) == 0


def test_on_release_scrub_waits_for_a_deferred_release() -> None:
    pool = make_pool(1, ScrubPolicy.ON_RELEASE)
    a = pool.register_owner("a")
    (h,) = pool.allocate(a, 1)
    pool.begin_inbound([h])
    pool.release([h])
    pool.k[:, h.index] = 3.0  # the late transfer lands
    pool.end_inbound([h.index])
    assert bool((pool.k[:, h.index] == 0).all())


# ---- deferred release (I7) ------------------------------------------------------------------


def test_release_during_inbound_transfer_is_deferred_until_end_inbound() -> None:
    pool = make_pool(num_pages=2)
    a, b = pool.register_owner("a"), pool.register_owner("b")
    handles = pool.allocate(a, 2)
    pool.begin_inbound(handles[:1])
    pool.release(handles)
    pending = handles[0].index
    assert int(pool.state[pending]) == PageState.PENDING_RELEASE
    assert int(pool.owner[pending]) == FREE_OWNER  # invalidated at once (I5)
    assert (pool.num_free, pool.num_pending) == (1, 1)
    pool.check_integrity()
    got = pool.allocate(b, 1)
    assert got[0].index != pending
    with pytest.raises(PoolExhausted):
        pool.allocate(b, 1)
    pool.end_inbound([pending])
    assert int(pool.state[pending]) == PageState.FREE
    assert pool.allocate(b, 1)[0].index == pending
    pool.check_integrity()


def test_pending_page_cannot_be_released_twice() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 1)
    pool.begin_inbound(handles)
    pool.release(handles)
    with pytest.raises(IsolationViolation, match="pending_release"):
        pool.release(handles)


def test_end_inbound_on_a_live_page_only_clears_the_flag() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 1)
    pool.begin_inbound(handles)
    pool.end_inbound([handles[0].index])
    assert int(pool.state[handles[0].index]) == PageState.USED
    pool.release(handles)
    assert pool.num_free == 6


def test_begin_inbound_needs_a_current_handle() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 1)
    pool.release(handles)
    with pytest.raises(IsolationViolation):
        pool.begin_inbound(handles)


def test_early_free_fault_hands_out_a_page_a_transfer_may_still_write() -> None:
    pool = make_pool(1, ScrubPolicy.NONE, Fault.EARLY_FREE)
    a, b = pool.register_owner("a"), pool.register_owner("b")
    handles = pool.allocate(a, 1)
    pool.begin_inbound(handles)
    pool.release(handles)
    assert pool.allocate(b, 1)[0].index == handles[0].index  # the bug: reused mid-transfer


# ---- I1: verify -----------------------------------------------------------------------------


def test_verify_passes_for_the_owner_reading_what_it_wrote() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 3)
    write(pool, handles, 10)
    read(pool, handles, a, 10)
    read(pool, handles, a, 0)
    read(pool, handles[:2], a, 8)


def test_verify_passes_for_a_shared_tenant_prefix_page() -> None:
    pool = make_pool()
    tenant = pool.register_owner("tenant-x prefix cache")
    r1, r2 = pool.register_owner("req-1"), pool.register_owner("req-2")
    prefix = pool.allocate(tenant, 1)
    write(pool, prefix, PAGE)
    own1, own2 = pool.allocate(r1, 1), pool.allocate(r2, 1)
    write(pool, own1, 2)
    write(pool, own2, 3)
    pool.verify(
        BatchPages.build(
            [prefix + own1, prefix + own2], [r1, r2], [tenant, tenant], [PAGE + 2, PAGE + 3]
        )
    )


def test_verify_fails_for_a_wrong_owner() -> None:
    pool = make_pool()
    a, b = pool.register_owner("req-a"), pool.register_owner("req-b")
    ha = pool.allocate(a, 1)
    write(pool, ha, PAGE)
    with pytest.raises(IsolationViolation) as info:
        read(pool, ha, b, PAGE)  # b holds a's handle but is not entitled to it
    assert info.value.page == ha[0].index
    assert "req-a gen 0" in info.value.expected
    assert "req-a gen 0" in info.value.found
    assert "req-b" in str(info.value)
    forged = [PageHandle(ha[0].index, 0, b)]
    with pytest.raises(IsolationViolation) as info:
        read(pool, forged, b, PAGE)  # a forged handle naming b does not match the ledger
    assert "owner req-b" in info.value.expected and "owner req-a" in info.value.found


def test_verify_fails_for_a_stale_generation() -> None:
    pool = make_pool(num_pages=1)
    ns = pool.register_owner("tenant-prefix")
    old = pool.allocate(ns, 1)
    pool.release(old)
    new = pool.allocate(ns, 1)
    write(pool, new, PAGE)
    read(pool, new, ns, PAGE)
    with pytest.raises(IsolationViolation) as info:
        read(pool, old, ns, PAGE)
    assert info.value.page == old[0].index
    assert "gen 0" in info.value.expected and "gen 1" in info.value.found


def test_verify_fails_for_a_released_page() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 1)
    write(pool, handles, PAGE)
    pool.release(handles)
    with pytest.raises(IsolationViolation, match="free"):
        read(pool, handles, a, PAGE)


def test_verify_fails_for_a_namespace_the_reader_is_not_entitled_to() -> None:
    pool = make_pool()
    tenant_x, tenant_y = pool.register_owner("tenant-x"), pool.register_owner("tenant-y")
    reader = pool.register_owner("req-of-y")
    prefix_x = pool.allocate(tenant_x, 1)
    write(pool, prefix_x, PAGE)
    with pytest.raises(IsolationViolation) as info:
        pool.verify(BatchPages.build([prefix_x], [reader], [tenant_y], [PAGE]))
    assert info.value.page == prefix_x[0].index
    assert "req-of-y" in str(info.value)
    with pytest.raises(IsolationViolation):
        pool.verify(BatchPages.build([prefix_x], [reader], [FREE_OWNER], [PAGE]))


def test_verify_fails_for_positions_beyond_what_was_written() -> None:
    """The incident: 8 pages reserved, 1 written, attention over all 8."""
    pool = make_pool(num_pages=8)
    victim = pool.register_owner("victim")
    req = pool.register_owner("rejected-req")
    victim_pages = pool.allocate(victim, 8)
    write(pool, victim_pages, 8 * PAGE, value=9.0)
    pool.release(victim_pages)  # scrub policy NONE: the bytes stay
    reserved = pool.allocate(req, 8)  # same physical pages, stale bytes still there
    assert bool((pool.k[:, reserved[1].index] == 9.0).all())
    write(pool, reserved[:1], 1)
    read(pool, reserved, req, 1)
    with pytest.raises(IsolationViolation) as info:
        read(pool, reserved, req, 8 * PAGE)
    assert info.value.page == reserved[0].index  # page 0 holds 1 slot, the row needs 4
    assert ">= 4 slots written" in info.value.expected
    assert "1 slots written" in info.value.found
    write(pool, reserved[:1], PAGE)
    with pytest.raises(IsolationViolation) as info:
        read(pool, reserved, req, PAGE + 1)
    assert info.value.page == reserved[1].index
    assert "0 slots written" in info.value.found


def test_verify_fails_for_positions_past_the_page_table() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 2)
    write(pool, handles, 2 * PAGE)
    with pytest.raises(IsolationViolation, match="past its page table") as info:
        read(pool, handles, a, 2 * PAGE + 1)
    assert info.value.page == handles[1].index
    with pytest.raises(IsolationViolation, match="past its page table") as info:
        read(pool, [], a, 1)
    assert info.value.page == -1


def test_verify_checks_every_row_of_a_batch() -> None:
    pool = make_pool()
    a, b = pool.register_owner("a"), pool.register_owner("b")
    ha, hb = pool.allocate(a, 2), pool.allocate(b, 1)
    write(pool, ha, 2 * PAGE)
    write(pool, hb, PAGE)
    pool.verify(BatchPages.build([ha, hb], [a, b], [FREE_OWNER] * 2, [2 * PAGE, PAGE]))
    with pytest.raises(IsolationViolation) as info:
        pool.verify(BatchPages.build([ha, ha], [a, b], [FREE_OWNER] * 2, [2 * PAGE, PAGE]))
    assert info.value.page == ha[0].index


def test_no_ledger_check_fault_lets_the_wrong_owner_read() -> None:
    pool = make_pool(6, ScrubPolicy.NONE, Fault.NO_LEDGER_CHECK)
    a, b = pool.register_owner("a"), pool.register_owner("b")
    ha = pool.allocate(a, 1)
    read(pool, ha, b, PAGE)  # passes: the defence is off


def test_no_invalidate_fault_keeps_stale_handles_valid() -> None:
    pool = make_pool(1, ScrubPolicy.NONE, Fault.NO_INVALIDATE)
    ns = pool.register_owner("tenant-prefix")
    old = pool.allocate(ns, 1)
    pool.release(old)
    new = pool.allocate(ns, 1)
    assert new[0].generation == old[0].generation
    write(pool, new, PAGE)
    read(pool, old, ns, PAGE)  # passes: the stale handle reads the new allocation


# ---- check_integrity --------------------------------------------------------------------------


def test_check_integrity_passes_on_a_busy_consistent_pool() -> None:
    pool = make_pool()
    a, b = pool.register_owner("a"), pool.register_owner("b")
    ha, hb = pool.allocate(a, 2), pool.allocate(b, 2)
    pool.begin_inbound(hb)
    pool.release(hb)
    pool.check_integrity(ha)


CORRUPTIONS: dict[str, tuple[Callable[[KVPool, int], object], str]] = {
    "free-twice": (lambda p, used: p.free_pages.append(p.free_pages[0]), "twice"),
    "free-list-lost": (lambda p, used: p.free_pages.pop(), "disagree"),
    "free-owned": (lambda p, used: p.owner.__setitem__(p.free_pages[0], 5), "free but still owned"),
    "used-unowned": (
        lambda p, used: p.owner.__setitem__(used, FREE_OWNER),
        "used but have no owner",
    ),
    "free-inbound": (lambda p, used: p.inbound.__setitem__(p.free_pages[0], True), "may land"),
    "bad-state": (lambda p, used: p.state.__setitem__(p.free_pages[0], 7), "!= 6"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_check_integrity_names_a_corrupted_ledger(case: str) -> None:
    corrupt, message = CORRUPTIONS[case]
    pool = make_pool()
    held = pool.allocate(pool.register_owner("a"), 2)
    pool.check_integrity(held)
    corrupt(pool, held[0].index)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_check_integrity_rejects_a_stale_outstanding_handle() -> None:
    pool = make_pool()
    a = pool.register_owner("a")
    handles = pool.allocate(a, 1)
    pool.release(handles)
    with pytest.raises(AssertionError, match="stale handle"):
        pool.check_integrity(handles)


# ---- construction -----------------------------------------------------------------------------


def test_pool_rejects_zero_pages_and_mismatched_storage() -> None:
    with pytest.raises(ValueError, match="at least one page"):
        KVPool(GEOM, 0)
    k = torch.zeros(1)
    with pytest.raises(ValueError, match="does not match"):
        KVPool(GEOM, 2, storage=(k, k))


def test_pool_uses_caller_storage_and_reports_capacity() -> None:
    shape = (GEOM.num_layers, 3, PAGE, GEOM.num_kv_heads, GEOM.head_dim)
    k, v = torch.zeros(shape), torch.zeros(shape)
    pool = KVPool(GEOM, 3, storage=(k, v))
    assert pool.k is k and pool.v is v
    assert pool.capacity_tokens == 3 * PAGE
    assert pool.can_allocate(3) and not pool.can_allocate(4) and not pool.can_allocate(-1)


def test_batch_rows_must_match_readers_namespaces_and_lengths() -> None:
    pool = make_pool()
    a, b = pool.register_owner("a"), pool.register_owner("b")
    ha, hb = pool.allocate(a, 1), pool.allocate(b, 1)
    with pytest.raises(ValueError, match="2 tables, 1 readers"):
        BatchPages.build([ha, hb], [a], [FREE_OWNER, FREE_OWNER], [0, 0])
    with pytest.raises(ValueError, match="1 lengths"):
        BatchPages.build([ha, hb], [a, b], [FREE_OWNER, FREE_OWNER], [0])
