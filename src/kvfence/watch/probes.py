"""The guard's low-rate probes: one canary pair (signal 2) and a timing window (signal 3).

Both reuse the audit's own pieces — sentinel prompts and leak search from
`audit.canary`, the TTFT-vs-length analysis from `audit.latency` — so a
crossing or a too-fast prefill means what it means in the audit.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace

from kvfence.audit.base import Verdict
from kvfence.audit.checks.canary.check import (
    A_MAX_TOKENS,
    B_MAX_TOKENS,
    Planted,
    find_leak,
    fragments_from_chars,
    plan_lengths,
)
from kvfence.audit.checks.latency.check import (
    LatencyAnalysis,
    LatencyConfig,
    LatencySample,
    analyse,
    design_p_value,
)
from kvfence.audit.client import ProbeClient
from kvfence.audit.prompts import PromptMaker, make_sentinel, random_words
from kvfence.audit.targets.base import TargetFacts

# Each interval times the longest prompt and its neighbour length twice each (the test
# compares the two) and one more shorter length in rotation (the short bucket and the fit).
PAIRS_PER_ROUND = 2
ROUND = 2 * PAIRS_PER_ROUND + 1
# The window holds at least this many rounds: 80 long, 80 neighbour, 200 probes in all (40
# minutes at the default interval). Under load the long and neighbour times overlap; 80
# against 80 still reaches p ~ 1e-9 then, where 40 against 40 hovered near the alpha.
MIN_ROUNDS = 40
# The window reaches alpha even when a quarter of the long probes miss the floor
# (design_p_value): under load, placeholder answers queue behind other work like any other.
SLACK = 20
# The guard judges its window every interval, forever, under whatever load the engine has.
# Error control is the test's own: each judgement is the audit's exact test at the per-test
# alpha that the operator's false-alarm budget allows (watch.budget), so no streak rule is
# needed. The physics must be established beyond the audit's bar (strict_physics: the
# slope's lower 95% bound is uphill too), so an engine with no measurable prefill cost
# never alarms.
WATCH_LATENCY = LatencyConfig(strict_physics=True)


def window_rounds(alpha: float) -> int:
    """Rounds in the window: enough that a total skip reaches alpha with SLACK to spare."""
    rounds = MIN_ROUNDS
    while 2 * design_p_value(n := rounds * PAIRS_PER_ROUND, n, SLACK) >= alpha and rounds < 512:
        rounds += 1
    return rounds


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
    """Fresh-prompt TTFTs at the sweep's lengths; judged by the audit's latency test at ``alpha``."""

    alpha: float
    config: LatencyConfig = field(init=False)
    samples: deque[LatencySample] = field(init=False)
    turn: int = 0

    def __post_init__(self) -> None:
        self.config = replace(WATCH_LATENCY, alpha=self.alpha)
        self.samples = deque(maxlen=window_rounds(self.alpha) * ROUND)

    def clear(self) -> None:
        self.samples.clear()

    def probe(self, client: ProbeClient, limit: int, rng: random.Random) -> int:
        """One round: the longest accepted prompt and its neighbour (twice each), then one
        shorter length in rotation. Returns requests sent."""
        lengths = self.config.sweep(limit)
        others = lengths[:-2] or lengths
        pair = [lengths[-1], lengths[-2] if len(lengths) > 1 else lengths[0]]
        plan = pair * PAIRS_PER_ROUND + [others[self.turn % len(others)]]
        self.turn += 1
        lo, hi = self.config.token_range
        for n in plan:
            r = client.ttft([rng.randrange(lo, hi) for _ in range(n)])
            if r.ok and r.ttft_s is not None:
                self.samples.append(LatencySample(n, r.ttft_s, "ttft", f"{n} tokens"))
        return len(plan)

    def judge(self) -> tuple[LatencyAnalysis, bool]:
        """The window's analysis, and whether it is an alarm (FAIL: p < alpha, physics shown)."""
        result = analyse(list(self.samples), self.config)
        return result, result.verdict is Verdict.FAIL
