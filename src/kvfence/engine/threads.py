"""Intra-op threads: one OpenMP team per server process, the engine thread's.

libgomp (torch's OpenMP runtime) lets a waiting worker spin before it sleeps on
a futex when the user asks for spinning (OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT;
kvfence's own default is PASSIVE, cli.py), but only while it manages no more
threads than the machine has CPUs; past that it spins about 1,000 iterations.
A team, once started, stays for the life of its master thread. So a server
whose main thread ran one parallel op (loading the model copies the weights
with torch's default threads) keeps an idle worker that the engine thread's
own team then tips over the CPU count, and every parallel region of a step
pays a futex sleep and wake. Measured under libgomp's default waits on 2 cores,
SmolLM2-135M geometry, batch 1: 48 ms a decode step on the engine thread
instead of 37 ms.

So the thread that builds the server keeps one intra-op thread (it never
starts a team) and the engine thread alone runs the role's threads.
"""

from __future__ import annotations

import torch


def keep_one_for_engine(requested: int) -> int:
    """Call on the building thread before any torch work: it keeps 1 thread from now on.

    Returns the engine thread's intra-op threads: `requested`, or torch's default
    (the CPU count) when it is 0.
    """
    threads = requested or torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def enter_engine_thread(threads: int) -> None:
    """The engine thread's first call: its own intra-op threads (0 leaves torch's setting)."""
    if threads:
        torch.set_num_threads(threads)
