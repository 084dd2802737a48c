"""bench/cpu_time.py against processes that burn a known amount of CPU: the root itself, a
child it reaps, and a grandchild orphaned outside the tree; then the root exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.cpu_time import Reading, Sampling, TreeMeter, interpolate  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")

BURN_S = 0.3
# Ticks are 10 ms and each process is rounded on its own; a fork, pipe reads and the polls
# of a sleeping process add a few ms. A lost process would be off by BURN_S.
SLACK_S = 0.08
# A bound on each wait for the tree, only there so a stuck child fails the test: at load 35
# on 2 cores a 0.3 CPU-s burn has taken over 60 s of wall time.
WAIT_S = 240  # under the suite's 300 s per test

# Steps on stdin; each burn spends BURN_S of the burning process's own CPU time.
TREE = f"""
import os, signal, sys, time

def burn():
    end = time.process_time() + {BURN_S}
    while time.process_time() < end:
        pass

def say(word):
    sys.stdout.write(word + "\\n")
    sys.stdout.flush()

say("ready")
assert sys.stdin.readline().strip() == "go"
burn()                      # the root's own time
a = os.fork()
if a == 0:
    burn()
    os._exit(0)
os.waitpid(a, 0)            # reaped by the root: in its cutime from now on
b = os.fork()
if b == 0:
    g = os.fork()
    if g == 0:              # orphaned when b dies: burns outside the tree's parentage
        say(f"g {{os.getpid()}}")
        while os.getppid() == b:
            time.sleep(0.01)
        burn()
        say("g-done")
        while True:
            time.sleep(60)
    while True:
        time.sleep(60)
say("b-up")
assert sys.stdin.readline().strip() == "orphan"
os.kill(b, signal.SIGKILL)
os.waitpid(b, 0)
assert sys.stdin.readline().strip() == "exit"
"""


def expect(proc: subprocess.Popen[str], word: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith(word), f"the burning tree said {line!r}, expected {word!r}"
    return line


def send(proc: subprocess.Popen[str], word: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(word + "\n")
    proc.stdin.flush()


def test_tree_cpu_counts_reaped_orphaned_and_exited_members() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    orphan = 0
    try:
        expect(proc, "ready")
        meter = TreeMeter((proc.pid,))
        start = meter.read()
        send(proc, "go")
        got = {expect(proc, ""), expect(proc, "")}  # "b-up" and "g PID", either order
        orphan = int(next(w for w in got if w.startswith("g ")).split()[1])
        assert meter.read().members == 3  # root, b, g: g is seen while b is its parent
        send(proc, "orphan")
        expect(proc, "g-done")
        burnt = meter.read()
        spent = burnt.cpu_s - start.cpu_s
        assert abs(spent - 3 * BURN_S) < SLACK_S, f"{spent:.3f} CPU-s for {3 * BURN_S:.2f} burnt"
        assert burnt.members == 2 and burnt.departed == 0  # b was reaped by the root

        send(proc, "exit")
        assert proc.wait(timeout=WAIT_S) == 0
        after_exit = meter.read()  # the root is gone, reaped by this test: outside the tree
        assert after_exit.departed == 1
        assert abs(after_exit.cpu_s - burnt.cpu_s) < SLACK_S, "the root's time was dropped"
    finally:
        if orphan:
            os.kill(orphan, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_interpolate_places_a_moment_between_readings() -> None:
    rs = [Reading(10.0, 0.0, 1, 0), Reading(12.0, 3.0, 1, 0), Reading(14.0, 3.0, 1, 0)]
    assert interpolate(rs, 11.0) == pytest.approx(1.5)
    assert interpolate(rs, 12.0) == 3.0
    assert interpolate(rs, 13.5) == 3.0
    with pytest.raises(ValueError, match="outside the readings"):
        interpolate(rs, 14.5)


def test_sampling_reads_on_its_own_while_the_tree_works() -> None:
    burn = (
        f"import time\nend = time.process_time() + {BURN_S}\nwhile time.process_time() < end: pass"
    )
    proc = subprocess.Popen([sys.executable, "-c", burn])
    try:
        with Sampling(TreeMeter((proc.pid,)), interval_s=0.1) as sampling:
            proc.wait(timeout=WAIT_S)
            sampling.read()
        assert len(sampling.readings) >= 3
        cpu = [r.cpu_s for r in sampling.readings]
        assert cpu == sorted(cpu) and cpu[-1] > 0.0
    finally:
        proc.kill()
        proc.wait()
