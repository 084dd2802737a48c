"""The stack's co-located workers share the host's cores step by step (sglang_stack/cores.py).

A worker stepping alone takes every core; beside another stepping worker, its share; once
the other goes idle, every core again. The scoreboard is a real shared file, read and written
through two `CoreShare` views as the two worker processes do, and the thread counts are what
each view asks its engine thread to set. Cores that other work on the host keeps busy are
not taken (the free cores are the test's, and `FreeCores` is read from given CPU times). The
stack gives each worker its own byte of one board when asked to, and none by default.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfence.sglang_stack.cores import ENV, CoreShare, CoreShareSpec, CpuTimes, FreeCores
from kvfence.sglang_stack.stack import Stack, StackSpec


def _views(
    tmp_path: Path, cores: int, slots: int = 2, free: list[float | None] | None = None
) -> tuple[list[CoreShare], list[list[int]]]:
    """Views of one board; `free` (the cores this worker could have had lately) is read on
    every step, every core when not given: nothing else runs."""
    board = tmp_path / "cores"
    CoreShareSpec.create(board, slots)
    calls: list[list[int]] = [[] for _ in range(slots)]
    now = free if free is not None else [float(cores)]
    views = [
        CoreShare(CoreShareSpec(str(board), i, slots, cores), calls[i].append, lambda: now[0])
        for i in range(slots)
    ]
    return views, calls


def test_a_worker_alone_takes_every_core_and_its_share_beside_the_other(tmp_path: Path) -> None:
    (prefill, decode), calls = _views(tmp_path, cores=2)
    decode.stepping(True)  # decode alone: both cores
    assert decode.threads == 2
    prefill.stepping(True)  # prefill joins: it takes one core ...
    assert prefill.threads == 1
    decode.stepping(True)  # ... and decode's next step gives one back
    assert decode.threads == 1
    prefill.stepping(False)  # prefill idle: decode's next step has both again
    decode.stepping(True)
    assert decode.threads == 2
    assert calls == [[1], [2, 1, 2]]  # set only when the count changes


def test_an_idle_worker_sets_no_threads_and_a_closed_one_counts_as_idle(tmp_path: Path) -> None:
    (a, b, c), calls = _views(tmp_path, cores=4, slots=3)
    a.stepping(False)
    assert calls[0] == []  # idle: its threads are not touched
    b.stepping(True)
    c.stepping(True)
    assert (b.threads, c.threads) == (4, 2)
    c.close()  # a worker that stops frees its mark
    b.stepping(True)
    assert b.threads == 4


def test_cores_other_work_keeps_busy_are_not_taken(tmp_path: Path) -> None:
    free: list[float | None] = [1.0]  # this worker's own core and nothing more
    (_, decode), calls = _views(tmp_path, cores=2, free=free)
    decode.stepping(True)
    assert decode.threads == 1
    free[0] = 1.6  # most of a second core, not enough for a team member to keep up
    decode.stepping(True)
    assert decode.threads == 1
    free[0] = 1.75  # the second core was free but for a quarter
    decode.stepping(True)
    assert decode.threads == 2
    free[0] = 1.3  # other work came back: one thread again
    decode.stepping(True)
    assert decode.threads == 1
    assert calls[1] == [1, 2, 1]
    unknown = CoreShare(decode.spec, calls[1].append, lambda: None)
    unknown.stepping(True)  # where the kernel does not say: the share alone decides
    assert unknown.threads == 2


def _times(idle: int, total: int, own_s: float, at_s: float) -> CpuTimes:
    return CpuTimes(idle=idle, total=total, own_s=own_s, at_s=at_s)


def test_free_cores_are_the_hosts_idle_ones_plus_the_workers_own() -> None:
    # 2 cores, ticks summed over both: 100 ticks a second each, 200 in all.
    reads = [
        _times(idle=0, total=0, own_s=0.0, at_s=0.0),
        _times(idle=10, total=20, own_s=0.05, at_s=0.1),  # inside the window: not read
        _times(idle=100, total=200, own_s=1.0, at_s=1.0),  # a core idle, one this worker's
        _times(idle=100, total=400, own_s=1.5, at_s=2.0),  # nothing idle, half a core its own
        _times(idle=100, total=600, own_s=3.5, at_s=3.0),  # both cores its own (two threads)
    ]
    free = FreeCores(cores=2, window_s=0.2, read=iter(reads).__next__)
    assert free() is None  # nothing measured yet
    assert free() == pytest.approx(2.0)
    assert free() == pytest.approx(0.5)
    assert free() == pytest.approx(2.0)  # a worker's own two threads are no busy host


def test_the_spec_travels_in_the_environment_and_a_bad_one_is_named() -> None:
    spec = CoreShareSpec("/run/cores", 1, 2, 8)
    assert CoreShareSpec.from_env(spec.to_env()) == spec
    assert CoreShareSpec.from_env({}) is None
    with pytest.raises(ValueError, match=f"{ENV} is not a core share.*slot 2 outside 0..1"):
        CoreShareSpec.from_env({ENV: '{"path": "x", "slot": 2, "slots": 2, "cores": 2}'})
    with pytest.raises(ValueError, match=f"{ENV} is not a core share"):
        CoreShareSpec.from_env({ENV: "two cores"})


def test_the_stack_gives_each_worker_its_own_byte_of_one_board(tmp_path: Path) -> None:
    spec = StackSpec(
        ("--model", "m"), tmp_path / "tenants.json", n_prefill=1, n_decode=2, share_cores=True
    )
    stack = Stack(spec, workdir=tmp_path)
    envs = [stack._core_share(slot, 3) for slot in range(3)]
    specs = [CoreShareSpec.from_env(env) for env in envs]
    assert [s.slot for s in specs if s is not None] == [0, 1, 2]
    assert {s.path for s in specs if s is not None} == {str(tmp_path / "cores")}
    assert (tmp_path / "cores").read_bytes() == bytes(3)  # nobody stepping yet
    fixed = Stack(StackSpec(("--model", "m"), tmp_path / "t.json"), tmp_path)
    assert fixed._core_share(0, 2) == {}  # off unless asked for
