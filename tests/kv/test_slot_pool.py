"""The ledger as a library: `SlotPool`, and the three-question harness on three pools.

The harness passes on the safe `SlotPool` and on `KVPool` (the engine's own
pool, read through its `verify`), and fails, with a shrunk minimal sequence,
on the article's unsafe pool and on a `KVPool` with invalidation switched off.
The game-backend example runs here as a user would run it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from kvfence.faults import Fault, FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.harness import KVPoolUnderTest, PoolUnsafe, SlotPoolUnderTest, check_pool
from kvfence.kv.ledger import IsolationViolation, PoolExhausted
from kvfence.kv.pool import KVPool
from kvfence.kv.slots import SlotPool

EXAMPLE = Path(__file__).parents[2] / "examples" / "session_slots.py"
GEOM = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, page_size=4, dtype="float32")


def test_allocation_is_all_or_nothing() -> None:
    pool = SlotPool(3, make=dict, reset=dict.clear)
    a = pool.register_owner("a")
    assert len(pool.allocate(a, 2)) == 2
    with pytest.raises(PoolExhausted, match="slot pool exhausted: requested 2 slots, 1 free"):
        pool.allocate(a, 2)
    assert pool.try_allocate(a, 2) is None and pool.num_free == 1  # nothing was taken
    pool.check_integrity()


def test_release_resets_and_a_stale_handle_fails_loudly() -> None:
    pool = SlotPool(1, make=dict, reset=dict.clear)
    a, b = pool.register_owner("a"), pool.register_owner("b")
    (slot,) = pool.allocate(a, 1)
    pool.get(slot)["score"] = 10
    pool.release([slot])
    with pytest.raises(IsolationViolation, match="stale handle"):
        pool.get(slot)
    (again,) = pool.allocate(a, 1)  # the same owner, the same physical slot...
    assert again.index == slot.index and again.generation == slot.generation + 1
    with pytest.raises(IsolationViolation, match="gen 0"):
        pool.get(slot)  # ...and only the generation tells the two grants apart
    assert pool.get(again) == {}  # reset: nothing of the first grant is left
    pool.release([again])
    (other,) = pool.allocate(b, 1)
    assert pool.get(other) == {}
    with pytest.raises(IsolationViolation):
        pool.release([slot])  # a double free is refused
    pool.check_integrity([other])


def test_check_integrity_names_a_corrupted_ledger() -> None:
    pool = SlotPool(2, make=dict, reset=dict.clear)
    held = pool.allocate(pool.register_owner("a"), 1)
    pool.owner[pool.free_slots[0]] = 5
    with pytest.raises(AssertionError, match="free but still owned"):
        pool.check_integrity(held)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: SlotPoolUnderTest(6), id="SlotPool"),
        pytest.param(lambda: KVPoolUnderTest(KVPool(GEOM, 6)), id="KVPool"),
    ],
)
def test_the_harness_passes_on_the_safe_pools(make: object) -> None:
    check_pool(make, largest_request=4, max_examples=60)  # type: ignore[arg-type]


def test_the_harness_asks_question_one() -> None:
    """A pool smaller than the largest accepted request is found at once."""
    with pytest.raises(PoolUnsafe, match="largest accepted request") as e:
        check_pool(lambda: SlotPoolUnderTest(3), largest_request=4, max_examples=20)
    assert e.value.steps.splitlines() == ["state = PoolMachine()", "state.largest_fits(who=0)"]


def test_the_harness_finds_release_unsafe_with_a_minimal_sequence() -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from session_slots import ReleaseUnsafe
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    with pytest.raises(PoolUnsafe, match="released handle still read") as e:
        check_pool(lambda: ReleaseUnsafe(6), largest_request=4)
    steps = e.value.steps.splitlines()
    assert steps[0] == "state = PoolMachine()" and len(steps) <= 4, e.value.steps
    assert "read_stale" in steps[-1]


def test_the_harness_finds_a_kv_pool_that_does_not_invalidate() -> None:
    """The lab's `no-invalidate` switch (the article's ReleaseUnsafe) on the engine's own pool."""
    unsafe = FaultSet.of(Fault.NO_INVALIDATE)
    with pytest.raises(PoolUnsafe) as e:
        check_pool(lambda: KVPoolUnderTest(KVPool(GEOM, 6, faults=unsafe)), largest_request=4)
    assert len(e.value.steps.splitlines()) <= 5, e.value.steps


def test_the_game_backend_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert "SessionSlots: the three questions answered right" in out
    assert "ReleaseUnsafe: unsafe, as expected" in out and "state.read_stale" in out
