"""Would a sweep have seen a skipped prefill? The latency test run on the sweep as if the
long prompts had not been prefilled: what decides whether a PASS means anything."""

from __future__ import annotations

import numpy as np

from kvfence.audit.checks.latency.exact import Buckets, Floor, LatencySample, Test, exact_test
from kvfence.audit.stats import percentile, robust_sigma

__all__ = ["paid_test", "skip_test"]


def skip_test(
    b: Buckets,
    skipped_fraction: float,
    material_fraction: float,
    noise_floor_s: float,
    against: list[LatencySample] | None = None,
) -> Test | None:
    """The same exact test on this sweep with every long probe's time replaced by a short
    probe's, in order: what the long prompts would show had none of them been prefilled.

    Whether this sweep could fail a skip: it answers with the data at hand. A real skip
    puts short prompts' times in the long bucket, but with its own draw of the noise, and
    at the edge a sweep whose short prompts happened to come in quick reaches alpha while a
    skip's own draw does not (seeded sweeps, uniform and long-tailed delays: up to a third
    of skips passed at alpha itself, 1 in 40 at alpha / 1000). So the sweep vouches only
    when it puts the skip ``skip_margin`` (1e-4) below alpha: then a placeholder that costs
    less than the neighbours by much of their extra cost is seen too. Even there a skip's
    own draw can come in slow enough to pass (1 to 2 in 100 seeded sweeps with long-tailed
    delays): `paid_test` asks the long prompts themselves.

    ``against``: the bucket the short prompts' times are compared with (default: the
    neighbours, as the test does).
    """
    if not b.short or not b.long or not b.neighbour:
        return None
    compared = b.neighbour if against is None else against
    skipped = [
        LatencySample(s.prompt_tokens, b.short[i % len(b.short)].seconds, s.kind, s.source)
        for i, s in enumerate(b.long)
    ]
    pooled = [s.seconds for s in skipped + compared]
    short_t = [s.seconds for s in b.short]
    floor = Floor(
        float(np.median(short_t)),
        max(robust_sigma(short_t), noise_floor_s),
        percentile(pooled, 75.0),
        float(np.median(pooled)),
        skipped_fraction,
    )
    as_if = Buckets(b.short, compared, skipped, b.reference)
    return exact_test(as_if, floor, material_fraction)


def paid_test(
    b: Buckets, skipped_fraction: float, material_fraction: float, noise_floor_s: float
) -> Test | None:
    """Whether the long prompts themselves paid for their prefill: the skip test with the
    long bucket in the neighbours' place (are short prompts' times told apart from the long
    prompts' own?).

    A pass needs it beside the skip test, both at alpha x margin. The skip test asks
    whether this sweep could have seen a skip, and answers with the short prompts' draw of
    the noise; a skip's own draw can still land the long prompts among the neighbours.
    This asks the long prompts directly: skipped, their times are drawn like the short
    prompts', and the exact test
    tells two draws of one distribution apart at a level with about that chance (exactly
    for the median labelling; the floor starts at the short bucket's own median, and
    seeded pairs of draws of one distribution came under 1% and 0.1% 0.4% and 0.1% of the
    time), so a total skip passes with about alpha x margin at most. Prefilled, they cost
    the most of any bucket and separate from the short prompts at least as plainly as the
    neighbours do (seeded sweeps: no honest pass lost).
    """
    return skip_test(b, skipped_fraction, material_fraction, noise_floor_s, against=b.long)
