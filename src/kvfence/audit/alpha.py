"""The audit's `--alpha`: split over the statistical checks, and designs big enough for it.

`kvfence audit --alpha A` bounds the family-wise false-alarm rate per target:
`AuditContext.alpha_for(check)` gives each statistical check A / (number of
statistical checks in the run) (Bonferroni: valid whatever the dependence
between the checks), and each check splits its share again over its own
tests. A share is only useful if the check's design can reach it: an exact
test's smallest p-value is fixed by its sample sizes, so each design here
grows with −log alpha until its most extreme outcome is below the level.
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvfence.audit.stats import SequentialDesign

MAX_PER_ARM = 512


def fisher_repeats_for(alpha: float, at_least: int) -> int:
    """Repeats per arm so that one-sided Fisher on r vs r can reach alpha: 1 / C(2r, r) < alpha."""
    r = max(1, at_least)
    while 1 / math.comb(2 * r, r) >= alpha and r < MAX_PER_ARM:
        r += 1
    return r


def sequential_design_for(design: SequentialDesign, alpha: float) -> SequentialDesign:
    """`design` at level alpha, with enough trials that its last look can reach alpha / looks.

    The exact one-sided KS p-value of n vs n samples is at least 1 / C(2n, n)
    (complete separation), so the budget grows by whole batches until that
    bound is below the per-look level.
    """
    sized = replace(design, alpha=alpha)
    while (
        1 / math.comb(2 * sized.max_per_arm, sized.max_per_arm) >= sized.alpha_per_look
        and sized.max_per_arm < MAX_PER_ARM
    ):
        sized = replace(sized, max_per_arm=sized.max_per_arm + sized.batch)
    return sized
