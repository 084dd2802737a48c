"""The guard's low-rate probes: one canary pair (signal 2) and a timing window (signal 3).

Both reuse the audit's own pieces — sentinel prompts and leak search from
`audit.canary`, the TTFT-vs-length analysis from `audit.latency` — so a
crossing or a too-fast prefill means what it means in the audit.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from kvfence.audit.base import Verdict
from kvfence.audit.canary import (
    A_MAX_TOKENS,
    B_MAX_TOKENS,
    Planted,
    find_leak,
    fragments_from_chars,
    plan_lengths,
)
from kvfence.audit.client import ProbeClient
from kvfence.audit.latency import LatencyAnalysis, LatencyConfig, LatencySample, analyse
from kvfence.audit.prompts import PromptMaker, make_sentinel, random_words
from kvfence.audit.targets.base import TargetFacts

WINDOW = 48  # timing samples judged together; cleared when the capacity facts change
REFS_PER_ROUND = 2  # shorter prompts timed per interval, beside one longest prompt
# The guard judges its window over and over, under whatever load the engine has: it
# alarms on the long bucket's lower quartile (a skipped prefill makes every long probe
# fast; one lucky probe must not page anyone), only when two windows in a row fail, and
# only when the physics is established beyond the audit's own bar: the slope's 95% CI
# excludes 0 and the predicted extra cost clears k x the spread of *every* shorter probe,
# not only the short bucket's (an engine with no measurable prefill cost never alarms).
WATCH_LATENCY = LatencyConfig(long_quantile=25.0)
STREAK = 2


@dataclass(frozen=True, slots=True)
class PairOutcome:
    crossed: bool
    sent: int
    detail: str


@dataclass(frozen=True, slots=True)
class Makers:
    """Prompt builders for tenants A and B (their filler is read once, then reused)."""

    a: PromptMaker
    b: PromptMaker

    @classmethod
    def of(cls, a: ProbeClient, b: ProbeClient, facts: TargetFacts, rng: random.Random) -> Makers:
        tokenize = facts.tokenizer.value == "/tokenize"
        return cls(
            PromptMaker(a, rng, use_tokenize=tokenize), PromptMaker(b, rng, use_tokenize=tokenize)
        )


def canary_pair(
    makers: Makers, facts: TargetFacts, limit: int, rng: random.Random, turn: int
) -> PairOutcome:
    """Tenant A plants a fresh sentinel; then tenant B sends one unrelated prompt (rotating
    through the audit's lengths, over-pool first); B's body must not hold the sentinel."""
    a, b = makers.a.client, makers.b.client
    a_lengths, b_lengths = plan_lengths(limit, facts)
    b_lengths.sort(key=lambda nl: "pool" not in nl[1])
    n_b, label = b_lengths[turn % len(b_lengths)]
    sentinel = make_sentinel(rng)
    sent0 = a.budget.sent
    pa = makers.a.make(max(a_lengths), sentinel, True)
    pb = makers.b.make(n_b, random_words(rng, 6))
    if pa is None or pb is None:
        return PairOutcome(False, a.budget.sent - sent0, "could not build the pair's prompts")
    planted = Planted(sentinel, fragments_from_chars(sentinel), pa.tokens)
    ra = a.completion(pa.payload, max_tokens=A_MAX_TOKENS)
    rb = b.completion(pb.payload, max_tokens=B_MAX_TOKENS)
    hit = find_leak(rb.searchable(), planted)
    sent = a.budget.sent - sent0
    if hit is not None:
        return PairOutcome(True, sent, f"A's sentinel reached B ({label}): matched {hit!r}")
    return PairOutcome(False, sent, f"A {ra.status}, B {label} {rb.status}: no crossing")


@dataclass(slots=True)
class TimingWindow:
    """Fresh-prompt TTFTs at the sweep's lengths; judged as the audit's latency check."""

    config: LatencyConfig = WATCH_LATENCY
    samples: deque[LatencySample] = field(default_factory=lambda: deque(maxlen=WINDOW))
    turn: int = 0
    failing: int = 0  # consecutive failing windows

    def clear(self) -> None:
        self.samples.clear()
        self.failing = 0

    def probe(self, client: ProbeClient, limit: int, rng: random.Random) -> int:
        """One round: the longest accepted prompt and REFS_PER_ROUND shorter ones. Returns sent."""
        lengths = self.config.sweep(limit)
        refs = lengths[:-1] or lengths
        plan = [lengths[-1]] + [refs[(self.turn + i) % len(refs)] for i in range(REFS_PER_ROUND)]
        self.turn += REFS_PER_ROUND
        lo, hi = self.config.token_range
        for n in plan:
            r = client.ttft([rng.randrange(lo, hi) for _ in range(n)])
            if r.ok and r.ttft_s is not None:
                self.samples.append(LatencySample(n, r.ttft_s, "ttft", f"{n} tokens"))
        return len(plan)

    def judge(self) -> tuple[LatencyAnalysis, bool]:
        """The window's analysis, and whether it is an alarm (STREAK failing windows in a row)."""
        result = analyse(list(self.samples), self.config)
        failed = result.verdict is Verdict.FAIL and self.established(result)
        self.failing = self.failing + 1 if failed else 0
        return result, self.failing >= STREAK

    def established(self, result: LatencyAnalysis) -> bool:
        fit, increment = result.fit, result.evidence.get("predicted_prefill_increment_s")
        if fit is None or not isinstance(increment, float):
            return False
        return fit.slope_low > 0 and increment >= self.config.tolerance_sigmas * fit.residual_sigma
