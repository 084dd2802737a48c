"""The latency check's timed warm-up: a few fresh prompts at the lengths the test compares,
sent before the sweep.

They place the sweep's neighbour (`resweep.closer_neighbour`: where the cost jumps past it)
and price the sweep, so that a sweep the audit's time cannot pay is refused before it
starts, with the pace that says why, instead of running out of time half-way and saying
nothing. None of them is tested: the sweep that decides is fresh, so choosing its shape
from these times leaves its H0 and its level as they were.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from kvfence.audit.base import JSONValue
from kvfence.audit.checks.latency.exact import LatencySample
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext

__all__ = ["Pace", "planned_probes", "time_warm_up"]


@dataclass(frozen=True, slots=True)
class Pace:
    """What the warm-up measured: every timed probe, and how many got no timing."""

    samples: tuple[LatencySample, ...]
    failed: int

    def median_s(self) -> dict[int, float]:
        """Median seconds per probe at each length timed."""
        lengths = sorted({s.prompt_tokens for s in self.samples})
        return {
            n: float(np.median([s.seconds for s in self.samples if s.prompt_tokens == n]))
            for n in lengths
        }

    def sweep_s(self, planned: dict[int, int]) -> float | None:
        """Seconds a sweep with ``planned`` probes per length takes at this pace (None: the
        warm-up timed nothing). Each length is priced at the nearest timed length at or
        above it (the longest timed where none is): a cost that grows with the length is
        never under-counted."""
        median = self.median_s()
        if not median:
            return None
        timed = sorted(median)

        def price(n: int) -> float:
            return median[next((m for m in timed if m >= n), timed[-1])]

        return sum(k * price(n) for n, k in planned.items())

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "timed": len(self.samples),
            "failed": self.failed,
            "median_s": {str(n): round(s, 4) for n, s in self.median_s().items()},
        }


def planned_probes(lengths: list[int], repeats: int) -> dict[int, int]:
    """Probes per length in a sweep: ``repeats`` at the lengths the test compares (the
    shortest, the neighbour, the longest), a third as many (at least 3) at the lengths
    between, which only feed the cost fit."""
    compared = {lengths[0], *lengths[-2:]}
    return {n: repeats if n in compared else max(3, -(-repeats // 3)) for n in lengths}


def time_warm_up(
    ctx: AuditContext,
    client: ProbeClient,
    lengths: list[int],
    rounds: int,
    untimed: int,
    token_range: tuple[int, int],
) -> Pace:
    """``untimed`` probes of the shortest length (the first requests pay one-off start-up
    costs), then ``rounds`` rounds of the compared lengths, each round in a fresh order."""
    rng = random.Random(ctx.rng.random())
    lo, hi = token_range
    for _ in range(untimed):
        client.ttft([rng.randrange(lo, hi) for _ in range(min(lengths))])
    compared = sorted({lengths[0], *lengths[-2:]})
    samples: list[LatencySample] = []
    failed = 0
    for i in range(rounds):
        order = rng.sample(compared, len(compared))
        for n in order:
            r = client.ttft([rng.randrange(lo, hi) for _ in range(n)])
            if r.ok and r.ttft_s is not None:
                samples.append(LatencySample(n, r.ttft_s, "ttft", f"warm-up {i}: {n} tokens"))
            else:
                failed += 1
        ctx.progress("prefill latency warm-up", (i + 1) / rounds)
    return Pace(tuple(samples), failed)
