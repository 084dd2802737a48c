"""The audit's `--alpha`: split over the statistical checks, and designs big enough for it.

`kvfence audit --alpha A` bounds the family-wise false-alarm rate per target:
`AuditContext.alpha_for(check)` gives each statistical check A / (number of
statistical checks in the run) (Bonferroni: valid whatever the dependence
between the checks), and each check splits its share again over its own
tests. A share is only useful if the check's design can reach it: an exact
test's smallest p-value is fixed by its sample sizes, so each design here
grows with −log alpha until its most extreme outcome is below the level.

Reaching the level is not enough for the sequential KS design: at 1e-9 its
default 24 trials per arm could only detect complete separation (a KS distance
of 1), so a real, noisy leak (real vLLM's shared prefix cache on a loaded
2-core machine: D ~ 0.5) passed with p = 3e-4. So a design also keeps the power
the default audit has at its own share: it grows until the KS distance its last
look can detect is no larger than the default audit's (`REFERENCE_SHARE`). At
the default alpha nothing changes; a smaller alpha buys its certainty with more
trials on an isolating target (a leak still stops at the first decisive look).

More trials alone leave the check at the mercy of the machine: real vLLM's
8-block (1,024-token) shared prefix saves ~15 ms of a ~27 ms prefill, and on a
loaded 2-core machine that shift is a KS distance of 0.5-0.9, so at 1e-9 one
audit in three stayed inconclusive at 64 trials per arm. The effect itself
grows with the prefix (a hit skips its whole prefill; the noise is the HTTP
path's, the same at any length), so the prefix also grows with the evidence
asked for: `evidence_scale` is the ratio of the design's per-look level to the
reference's, in log terms (the KS tail is exp(-D^2 n), so -log alpha is the
evidence a look needs), and the prefix takes that many times its default pages,
within the target's longest prompt. At the default alpha (or a larger one) the
scale is 1: the default audit's prompts are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvfence.audit.base import DEFAULT_ALPHA, STATISTICAL_CHECKS
from kvfence.audit.stats import SequentialDesign, ks_critical_distance

MAX_PER_ARM = 512
# The prefix-sharing check's share of the default audit (1e-3 over three statistical checks,
# split over its unsalted and salted runs): the power every other alpha is held to.
REFERENCE_SHARE = DEFAULT_ALPHA / len(STATISTICAL_CHECKS) / 2


def fisher_repeats_for(alpha: float, at_least: int) -> int:
    """Repeats per arm so that one-sided Fisher on r vs r can reach alpha: 1 / C(2r, r) < alpha."""
    r = max(1, at_least)
    while 1 / math.comb(2 * r, r) >= alpha and r < MAX_PER_ARM:
        r += 1
    return r


def sequential_design_for(design: SequentialDesign, alpha: float) -> SequentialDesign:
    """`design` at level alpha, with enough trials that its last look can reach alpha / looks
    and detect what the default audit's design detects (module docstring).

    The exact one-sided KS p-value of n vs n samples is at least 1 / C(2n, n)
    (complete separation), so the budget grows by whole batches until that
    bound is below the per-look level, then until the detectable distance is
    the reference's.
    """
    sized = replace(design, alpha=alpha)
    while not _reaches(sized) and sized.max_per_arm < MAX_PER_ARM:
        sized = replace(sized, max_per_arm=sized.max_per_arm + sized.batch)
    power = _detectable(reference_design(design))
    while _detectable(sized) > power and sized.max_per_arm < MAX_PER_ARM:
        sized = replace(sized, max_per_arm=sized.max_per_arm + sized.batch)
    return sized


def reference_design(design: SequentialDesign) -> SequentialDesign:
    """`design` at the reference share, grown until it can reach it (the default audit's)."""
    reference = replace(design, alpha=REFERENCE_SHARE)
    while not _reaches(reference) and reference.max_per_arm < MAX_PER_ARM:
        reference = replace(reference, max_per_arm=reference.max_per_arm + reference.batch)
    return reference


def evidence_scale(sized: SequentialDesign, configured: SequentialDesign) -> float:
    """How many times the default audit's evidence a look of `sized` (the `configured` design
    at the run's level) needs, in log-level terms (module docstring); never below 1: the
    factor the shared prefix grows by."""
    reference = reference_design(configured)
    return max(1.0, math.log(1 / sized.alpha_per_look) / math.log(1 / reference.alpha_per_look))


def _reaches(d: SequentialDesign) -> bool:
    """Complete separation at the last look is below the per-look level."""
    return 1 / math.comb(2 * d.max_per_arm, d.max_per_arm) < d.alpha_per_look


def _detectable(d: SequentialDesign) -> float:
    """The KS distance the design's last look can detect at its per-look level."""
    return ks_critical_distance(d.max_per_arm, d.max_per_arm, d.alpha_per_look)
