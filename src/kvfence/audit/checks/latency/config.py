"""The latency check's settings: the analysis' thresholds and the live sweep's shape."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvfence.audit.checks.latency.exact import design_p_value

__all__ = ["LatencyConfig"]


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    """Thresholds of the analysis and the live sweep's shape.

    ``skipped_fraction`` (f) places the "fast" floor; ``skip_margin``: how far below alpha
    the sweep must put a skip (`skip_test`), and the long prompts' own times must be told
    from the short prompts' (`paid_test`), to vouch for a pass; ``material_fraction`` how
    far below its neighbours the long bucket must be for the median labelling to count
    (module docstring). ``alpha``: the test's level; None takes the audit's share of
    its family-wise ``--alpha`` (`AuditContext.alpha_for`). ``repeats``: probes
    per length; None sizes them so the design reaches alpha with ``slack``
    probes to spare (`repeats_for`). ``lengths`` overrides the sweep (else
    geometric from ``min_tokens`` to the longest accepted prompt, ``points``
    lengths). ``long_quantile`` is reported, not judged. The live check runs up to
    ``sweeps`` fresh sweeps, each tested alone at alpha / ``sweeps`` (Bonferroni: the
    false-alarm rate stays <= alpha), the next only when one was ambiguous: inconclusive,
    or a pass with p < ``recheck_below`` (a leak blurred by the machine's load).
    ``near_fraction``: where the neighbour sits, as a fraction of the longest prompt, when
    the target's pool holds the longest prompt (`sweep`); ``pilot``: rounds of the timed
    warm-up at the compared lengths that place the neighbour and price the sweep.
    """

    skipped_fraction: float = 0.5
    skip_margin: float = 1e-4
    material_fraction: float = 0.25
    alpha: float | None = None
    long_quantile: float = 5.0
    repeats: int | None = None
    slack: int = 4
    max_repeats: int = 64
    points: int = 5
    min_tokens: int = 16
    max_tokens_cap: int | None = None
    lengths: tuple[int, ...] | None = None
    min_samples: int = 8
    noise_floor_s: float = 1e-4
    warmup: int = 1
    max_error_fraction: float = 0.2
    token_range: tuple[int, int] = (100, 500)
    strict_physics: bool = False
    sweeps: int = 2
    recheck_below: float = 0.5
    near_fraction: float = 0.75
    pilot: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.skipped_fraction <= 1 or not 0 < self.skip_margin <= 1:
            raise ValueError("need 0 < skipped_fraction <= 1 and 0 < skip_margin <= 1")
        if not 0 < self.long_quantile < 50:
            raise ValueError("long_quantile must be in (0, 50)")
        if self.alpha is not None and not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if (self.repeats is not None and self.repeats < 1) or self.points < 3:
            raise ValueError("need repeats >= 1 and points >= 3")
        if self.sweeps < 1 or not 0 < self.recheck_below <= 1:
            raise ValueError("need sweeps >= 1 and 0 < recheck_below <= 1")
        if self.min_tokens < 1 or self.slack < 0 or self.max_repeats < 1:
            raise ValueError("need min_tokens >= 1, slack >= 0 and max_repeats >= 1")
        if not 0.5 <= self.near_fraction < 1 or self.pilot < 0:
            raise ValueError("need 0.5 <= near_fraction < 1 and pilot >= 0")

    def sweep(self, longest_accepted: int, pool_tokens: int | None = None) -> list[int]:
        """The prompt lengths to probe, ending at the longest accepted prompt.

        Geometric up to the neighbour, then the longest. The test compares the long prompts
        with the neighbour, so the more of the long prompt's cost the neighbour pays, the
        wider the gap a skip opens between them: at half the longest, or at
        ``near_fraction`` of it where the pool (``pool_tokens``) holds the longest prompt.
        Below that a nearer neighbour could hide a skip: a reject path for prompts past the
        pool (the incident's) would skip a neighbour past the pool as well, and the two
        buckets would look alike (a sweep that cannot tell them apart never vouches for a
        pass, `skip_test`, but it cannot fail either).
        """
        if self.lengths is not None:
            return sorted(set(self.lengths))
        top = longest_accepted
        if self.max_tokens_cap is not None:
            top = min(top, self.max_tokens_cap)
        if top <= self.min_tokens:
            return [top]
        holds = pool_tokens is not None and pool_tokens >= top
        neighbour = int(top * (self.near_fraction if holds else 0.5))
        grid = np.geomspace(self.min_tokens, max(self.min_tokens, neighbour), self.points - 1)
        return sorted({round(float(v)) for v in grid} | {top})

    def repeats_for(self, alpha: float) -> int:
        """Probes per length: as configured, or the fewest whose design reaches alpha."""
        if self.repeats is not None:
            return self.repeats
        for r in range(1, self.max_repeats + 1):  # x 2: the two tests' Bonferroni split
            if 2 * design_p_value(r, r, self.slack) < alpha:
                return r
        return self.max_repeats

    def sweep_repeats(self, alpha: float) -> int:
        """Probes per compared length in a live sweep tested at alpha: as configured, or the
        fewest that both reach alpha (`repeats_for`) and can pass.

        A pass needs a skip (`skip_test`) and the long prompts' own cost (`paid_test`) told
        apart from the short prompts' times at alpha x ``skip_margin``. Sized for alpha
        alone, a sweep whose buckets separate completely just reaches that bar, and a few
        short probes slowed by load (four of 21 at the default level) leave it short: on a
        loaded machine no honest sweep could pass. So the sweep is sized until those tests
        can reach the bar with ``slack`` probes the wrong way.
        """
        if self.repeats is not None:
            return self.repeats
        bar = alpha * self.skip_margin
        for r in range(self.repeats_for(alpha), self.max_repeats + 1):
            if 2 * design_p_value(r, r, self.slack) < bar:
                return r
        return self.max_repeats
