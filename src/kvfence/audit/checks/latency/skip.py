"""Would a sweep have seen a skipped prefill? The latency test run on the sweep as if the
long prompts had not been prefilled: what decides whether a PASS means anything."""

from __future__ import annotations

import numpy as np

from kvfence.audit.checks.latency.exact import Buckets, Floor, LatencySample, Test, exact_test
from kvfence.audit.stats import percentile, robust_sigma

__all__ = ["skip_test"]


def skip_test(
    b: Buckets, skipped_fraction: float, material_fraction: float, noise_floor_s: float
) -> Test | None:
    """The same exact test on this sweep with every long probe's time replaced by a short
    probe's, in order: what the long prompts would show had none of them been prefilled.

    Whether a PASS means anything is whether this sweep, with its sizes, its noise and its
    level, would have failed a skip; this answers it with the data at hand. A real skip
    puts short prompts' times in the long bucket, which is this test, but with its own draw
    of the noise: at the edge a sweep whose short prompts happened to come in quick reaches
    alpha while a skip's own draw does not (seeded sweeps, uniform and long-tailed delays:
    up to a third of skips passed at alpha itself, 1 in 40 at alpha / 1000). So the sweep
    vouches only when it puts the skip ``skip_margin`` (1e-4) below alpha: there no skip
    passed in 600 seeded sweeps of 21 to 64 repeats, and every sweep that passed the honest
    prompts failed the skip of the same noise (a bar of 4 sigma of the short bucket passed
    3 skips in the same 600 and failed a skip in 42 of them; this rule fails 305).
    """
    if not b.short or not b.long or not b.neighbour:
        return None
    skipped = [
        LatencySample(s.prompt_tokens, b.short[i % len(b.short)].seconds, s.kind, s.source)
        for i, s in enumerate(b.long)
    ]
    pooled = [s.seconds for s in skipped + b.neighbour]
    short_t = [s.seconds for s in b.short]
    floor = Floor(
        float(np.median(short_t)),
        max(robust_sigma(short_t), noise_floor_s),
        percentile(pooled, 75.0),
        float(np.median(pooled)),
        skipped_fraction,
    )
    as_if = Buckets(b.short, b.neighbour, skipped, b.reference)
    return exact_test(as_if, floor, material_fraction)
