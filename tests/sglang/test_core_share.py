"""The stack's co-located workers take turns on the host's cores (sglang_stack/cores.py).

A worker holds every core for one step and hands them on; a worker that wants a step while
another holds them waits for that step's end; the one that stepped last lets a waiting
partner go first; a holder that is stuck, or dies, holds nobody off. The board is a real
shared file and the cores a real `flock` on it, taken through separate `CoreShare` views as
the worker processes do (a lock is per open file, so two views in one process contend as two
processes would), and the thread counts are what each view asks its engine thread to set.
Cores that other work on the host keeps busy are not taken (the free cores are the test's,
and `FreeCores` is read from given CPU times). The stack gives each worker its own slot of
one board unless told not to.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfence.sglang_stack import cores
from kvfence.sglang_stack.cores import ENV, CoreShare, CoreShareSpec, CpuTimes, FreeCores
from kvfence.sglang_stack.stack import Stack, StackSpec


def _views(
    tmp_path: Path, cores: int, slots: int = 2, free: list[float | None] | None = None
) -> tuple[list[CoreShare], list[list[int]]]:
    """Views of one board; `free` (the cores the stack could have had lately) is read on
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


def _step_in_thread(view: CoreShare, log: list[str], name: str) -> threading.Thread:
    """`view` asks for a step on another thread (another worker's engine thread)."""

    def run() -> None:
        with view.turn(True):
            log.append(f"{name} steps")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_wanting(view: CoreShare) -> None:
    deadline = time.monotonic() + 5
    while not view._slot(view.spec.slot)[0]:
        assert time.monotonic() < deadline, "the other worker never asked for the cores"
        time.sleep(0.001)


def test_a_worker_steps_on_every_core_and_an_idle_one_sets_nothing(tmp_path: Path) -> None:
    (prefill, decode), calls = _views(tmp_path, cores=2)
    with prefill.turn(False):
        pass
    assert calls[0] == []  # idle: its threads are not touched
    with decode.turn(True):
        assert decode.threads == 2
    with decode.turn(True):
        pass
    assert calls[1] == [2]  # set only when the count changes


def test_a_step_waits_for_the_holders_step_to_end(tmp_path: Path) -> None:
    (prefill, decode), _ = _views(tmp_path, cores=2)
    log: list[str] = []
    with prefill.turn(True):
        t = _step_in_thread(decode, log, "decode")
        _wait_wanting(decode)
        time.sleep(0.05)  # decode has asked and is waiting
        log.append("prefill steps")
    t.join(5)
    assert log == ["prefill steps", "decode steps"]
    assert decode.threads == 2  # its own turn, on every core


def test_the_worker_that_stepped_last_lets_a_waiting_one_go_first(tmp_path: Path) -> None:
    (prefill, decode), _ = _views(tmp_path, cores=2)
    log: list[str] = []
    with prefill.turn(True):
        log.append("prefill steps")
        t = _step_in_thread(decode, log, "decode")
        _wait_wanting(decode)
    # prefill released the cores and asks again at once: decode, waiting, goes first
    with prefill.turn(True):
        log.append("prefill steps")
    t.join(5)
    assert log == ["prefill steps", "decode steps", "prefill steps"]


def test_a_slot_wants_the_cores_only_during_its_turn(tmp_path: Path) -> None:
    # A worker gone idle after its step must not look like one waiting: the one that
    # stepped last would hold its next step back for it.
    (prefill, decode), _ = _views(tmp_path, cores=2)
    with decode.turn(True):
        assert prefill._slot(1)[0] == 1
    assert prefill._slot(1)[0] == 0
    with decode.turn(False):
        assert prefill._slot(1)[0] == 0


def test_a_stuck_holder_is_stepped_beside_at_the_split_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cores, "STUCK_S", 0.1)
    (prefill, decode), _ = _views(tmp_path, cores=2)
    log: list[str] = []
    with prefill.turn(True):
        t = _step_in_thread(decode, log, "decode")
        t.join(5)  # prefill never lets go: decode steps once the holder is past STUCK_S
        assert log == ["decode steps"]
        assert decode.threads == 1  # beside the holder, not on its cores


HOLDER = """
import os, sys, time
from kvfence.sglang_stack.cores import CoreShare, CoreShareSpec
share = CoreShare(CoreShareSpec(sys.argv[1], 0, 2, 2), lambda n: None, lambda: None)
turn = share.turn(True)  # kept: a dropped one would hand the cores back
turn.__enter__()
print("held", flush=True)
time.sleep(60)
"""


def test_a_holder_that_dies_gives_the_cores_back(tmp_path: Path) -> None:
    (_, decode), _ = _views(tmp_path, cores=2)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "cores")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        log: list[str] = []
        t = _step_in_thread(decode, log, "decode")
        _wait_wanting(decode)
        time.sleep(0.05)
        assert log == []  # the other process holds the cores
        holder.kill()  # it dies holding them
        t.join(5)
        assert log == ["decode steps"]
        assert decode.threads == 2  # the lock, not the split share: the holder is gone
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_that_died_past_the_stuck_bound_is_no_reason_to_step_beside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The board still names the dead holder, long past STUCK_S, and its slot still wants
    # the cores; this worker stepped last. The lock is free: it takes every core.
    monkeypatch.setattr(cores, "STUCK_S", 0.01)
    (prefill, _), _ = _views(tmp_path, cores=2)
    with prefill.turn(True):
        pass
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.replace("0, 2, 2", "1, 2, 2"), str(tmp_path / "cores")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.05)  # past the bound
    with prefill.turn(True):
        assert prefill.threads == 2


def test_cores_other_work_keeps_busy_are_not_taken(tmp_path: Path) -> None:
    free: list[float | None] = [1.0]  # the stack's own core and nothing more
    (_, decode), calls = _views(tmp_path, cores=2, free=free)

    def step() -> int:
        with decode.turn(True):
            return decode.threads

    assert step() == 1
    free[0] = 1.6  # most of a second core, not enough for a team member to keep up
    assert step() == 1
    free[0] = 1.75  # the second core was free but for a quarter
    assert step() == 2
    free[0] = 1.3  # other work came back: one thread again
    assert step() == 1
    assert calls[1] == [1, 2, 1]
    unknown = CoreShare(decode.spec, calls[1].append, lambda: None)
    with unknown.turn(True):  # where the kernel does not say: every core
        assert unknown.threads == 2


def _times(idle: int, total: int, stack_s: float, at_s: float) -> CpuTimes:
    return CpuTimes(idle=idle, total=total, stack_s=stack_s, at_s=at_s)


def test_free_cores_are_the_hosts_idle_ones_plus_the_stacks_own() -> None:
    # 2 cores, ticks summed over both: 100 ticks a second each, 200 in all.
    reads = iter(
        [
            _times(idle=0, total=0, stack_s=0.0, at_s=0.0),
            _times(idle=10, total=20, stack_s=0.05, at_s=0.1),  # inside the window: not read
            _times(idle=100, total=200, stack_s=1.0, at_s=1.0),  # a core idle, one the stack's
            _times(idle=100, total=400, stack_s=1.5, at_s=2.0),  # nothing idle, half a core its
            _times(idle=100, total=600, stack_s=3.5, at_s=3.0),  # both cores the stack's
        ]
    )
    asked: list[list[int]] = []

    def read(pids: list[int]) -> CpuTimes | None:
        asked.append(pids)
        return next(reads)

    free = FreeCores(cores=2, pids=lambda: [11, 12], window_s=0.2, read=read)
    assert free() is None  # nothing measured yet
    assert free() == pytest.approx(2.0)
    assert free() == pytest.approx(0.5)
    assert free() == pytest.approx(2.0)  # the stack's own two threads are no busy host
    assert asked == [[11, 12]] * 5  # the workers the board names, every read


def test_cpu_times_count_the_stacks_workers() -> None:
    import os

    mine = cores.cpu_times([os.getpid()])
    gone = cores.cpu_times([os.getpid(), 2**22 + 1])  # a pid no process has
    assert mine is not None and gone is not None
    assert mine.stack_s > 0 and gone.stack_s >= mine.stack_s  # a gone worker counts 0
    assert gone.total >= mine.total > 0


def test_the_spec_travels_in_the_environment_and_a_bad_one_is_named() -> None:
    spec = CoreShareSpec("/run/cores", 1, 2, 8)
    assert CoreShareSpec.from_env(spec.to_env()) == spec
    assert CoreShareSpec.from_env({}) is None
    with pytest.raises(ValueError, match=f"{ENV} is not a core share.*slot 2 outside 0..1"):
        CoreShareSpec.from_env({ENV: '{"path": "x", "slot": 2, "slots": 2, "cores": 2}'})
    with pytest.raises(ValueError, match=f"{ENV} is not a core share"):
        CoreShareSpec.from_env({ENV: "two cores"})


def test_the_stack_gives_each_worker_its_own_slot_of_one_board(tmp_path: Path) -> None:
    spec = StackSpec(("--model", "m"), tmp_path / "tenants.json", n_prefill=1, n_decode=2)
    stack = Stack(spec, workdir=tmp_path)
    envs = [stack._core_share(slot, 3) for slot in range(3)]
    specs = [CoreShareSpec.from_env(env) for env in envs]
    assert [s.slot for s in specs if s is not None] == [0, 1, 2]
    assert {s.path for s in specs if s is not None} == {str(tmp_path / "cores")}
    views = [CoreShare(s, lambda n: None) for s in specs if s is not None]
    assert [v._slot(i)[0] for v in views[:1] for i in range(3)] == [0, 0, 0]  # nobody wants
    split = Stack(StackSpec(("--model", "m"), tmp_path / "t.json", share_cores=False), tmp_path)
    assert split._core_share(0, 2) == {}  # the fixed split, when asked for
