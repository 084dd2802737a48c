"""The prefix-sharing probe's trials: A warms a prefix, B times a shared and a fresh prompt.

Each trial is three requests (A's warm-up, then B's shared-prefix and fresh prompts in a
random order); trials run in batches until the sequential KS test stops
(`check.py` turns what they showed into a verdict).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfence.audit.checks.prefix_sharing.prompts import Pieces, RandomPrompts
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.stats import SequentialDesign, SequentialKS, SequentialResult

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class PrefixSharingConfig:
    """Shape and limits of the probe.

    - ``prefix_pages`` pages of the target's page size (``default_page`` when
      unknown), at least ``min_prefix_tokens``, capped by what the target accepts.
    - ``design``: the sequential test (alpha, trials per look, max trials).
    - ``salt``: "auto" runs the salted variant when the target accepts
      ``cache_salt``; "off" never; "only" runs just the salted variant.
    - ``stop_on_cached_evidence``: stop as soon as ``cached_tokens`` proves a
      cross-tenant hit (the timing test would only confirm it).
    - ``token_range``: token ids are drawn from [low, high): ids every
      tokenizer has and none is special.
    - ``salt_routes``: where the target states a route drops ``cache_salt``
      (a router in front), the routes on which tenant A's own salts are
      tested (``salt_routes.py``); ``("completions",)`` for a
      deployment that sends salts there only.
    """

    prefix_pages: int = 16
    min_prefix_tokens: int = 256
    default_page: int = 16
    suffix_tokens: int = 8
    design: SequentialDesign = field(
        default_factory=lambda: SequentialDesign(alpha=1e-3, batch=8, max_per_arm=24)
    )
    salt: str = "auto"
    salt_routes: tuple[str, ...] = ("completions", "chat")
    salt_control_trials: int = 4
    stop_on_cached_evidence: bool = True
    token_range: tuple[int, int] = (100, 500)
    max_error_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.salt not in ("auto", "off", "only"):
            raise ValueError(f"salt must be auto, off or only, got {self.salt!r}")
        if self.prefix_pages < 1 or self.suffix_tokens < 1 or self.min_prefix_tokens < 1:
            raise ValueError("prefix_pages, suffix_tokens and min_prefix_tokens must be >= 1")
        if not set(self.salt_routes) <= set(ROUTES):
            raise ValueError(f"salt_routes must be among {', '.join(ROUTES)}")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ValueError("token_range must be 0 <= low < high")


@dataclass(slots=True)
class Arms:
    """Timings and evidence of one run (salted or not)."""

    shared: list[float] = field(default_factory=list)
    fresh: list[float] = field(default_factory=list)
    shared_cached: list[int] = field(default_factory=list)
    fresh_cached: list[int] = field(default_factory=list)
    requests: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    cross_hits: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cached_reported(self) -> bool:
        return bool(self.shared_cached or self.fresh_cached)


class TrialProbe:
    """Sends one trial's three requests and records what they showed."""

    def __init__(
        self,
        cfg: PrefixSharingConfig,
        rng: random.Random,
        client_a: ProbeClient,
        client_b: ProbeClient,
        prefix_len: int,
        route: str = "completions",
    ) -> None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
        self.cfg, self.rng = cfg, rng
        self.a, self.b = client_a, client_b
        self.prefix_len = prefix_len
        self.route = route
        self.prompts = RandomPrompts(rng, cfg.token_range)  # ids, or words where ids are refused

    def prompt(self, n: int) -> Pieces:
        return self.prompts.make(n)

    def send(self, client: ProbeClient, prompt: Pieces, salt: str | None) -> ProbeResponse:
        extra = {"cache_salt": salt} if salt is not None else None
        if self.route == "chat":  # text only: `prompts` is in text mode (prompts.py here)
            message = {"role": "user", "content": str(self.prompts.payload(prompt))}
            return client.chat([message], max_tokens=1, stream=True, extra=extra)
        return client.ttft(self.prompts.payload(prompt), extra=extra)

    def trial(self, arms: Arms, salt_a: str | None, salt_b: str | None) -> None:
        prefix = self.prompt(self.prefix_len)
        warm = self.send(self.a, prefix + self.prompt(self.cfg.suffix_tokens), salt_a)
        if self.prompts.refused(warm, self.a):
            arms.requests += 2  # the refused warm-up and the sizing sample
            prefix = self.prompt(self.prefix_len)
            warm = self.send(self.a, prefix + self.prompt(self.cfg.suffix_tokens), salt_a)
        arms.requests += 1
        if not warm.ok:
            arms.errors.append({"role": "A warm-up", **warm.brief()})
            return
        shared_prompt = prefix + self.prompt(self.cfg.suffix_tokens)
        fresh_prompt = self.prompt(self.prefix_len + self.cfg.suffix_tokens)
        order = [("shared", shared_prompt), ("fresh", fresh_prompt)]
        self.rng.shuffle(order)
        got: dict[str, ProbeResponse] = {}
        for arm, prompt in order:
            got[arm] = self.send(self.b, prompt, salt_b)
            arms.requests += 1
        if not all(r.ok and r.ttft_s is not None for r in got.values()):
            bad = [r for r in got.values() if not (r.ok and r.ttft_s is not None)]
            arms.errors.append({"role": "B probe", **bad[0].brief()})
            return
        shared, fresh = got["shared"], got["fresh"]
        assert shared.ttft_s is not None and fresh.ttft_s is not None
        arms.shared.append(shared.ttft_s)
        arms.fresh.append(fresh.ttft_s)
        if shared.cached_tokens is not None:
            arms.shared_cached.append(shared.cached_tokens)
        if fresh.cached_tokens is not None:
            arms.fresh_cached.append(fresh.cached_tokens)
        baseline = max(arms.fresh_cached, default=0)
        if shared.cached_tokens is not None and shared.cached_tokens > baseline:
            arms.cross_hits.append(
                {
                    "cached_tokens": shared.cached_tokens,
                    "fresh_max_cached_tokens": baseline,
                    "a_warmup": warm.brief(),
                    "b_shared_probe": shared.brief(),
                }
            )


def run_arms(
    probe: TrialProbe,
    cfg: PrefixSharingConfig,
    salt_a: str | None,
    salt_b: str | None,
    progress: Callable[[float], None] | None = None,
) -> tuple[Arms, SequentialResult | None]:
    """Trials in batches until the sequential test stops (or evidence / errors stop it)."""
    arms = Arms()
    test = SequentialKS(cfg.design)
    trials = 0
    while trials < cfg.design.max_per_arm:
        before = len(arms.shared)
        for _ in range(min(cfg.design.batch, cfg.design.max_per_arm - trials)):
            probe.trial(arms, salt_a, salt_b)
            trials += 1
            if cfg.stop_on_cached_evidence and arms.cross_hits:
                return arms, None  # the engine itself reports the cross-tenant hit
        if progress is not None:
            progress(trials / cfg.design.max_per_arm)
        if len(arms.errors) > cfg.max_error_fraction * max(trials, cfg.design.batch):
            return arms, None
        if cfg.stop_on_cached_evidence and arms.cross_hits:
            return arms, None
        result = test.add(arms.shared[before:], arms.fresh[before:])
        if result is not None:
            return arms, result
    # A failed trial in the first batch skips that look: the budget, not the looks, ran out.
    return arms, test.finish()


def same_salt_trials(
    probe: TrialProbe, salt_a: str | None, cfg: PrefixSharingConfig
) -> tuple[Arms, SequentialResult | None]:
    """A re-reads its own prefixes with its own salt ("B" is A here) until a hit shows."""
    own = Arms()
    test = SequentialKS(cfg.design)
    result: SequentialResult | None = None
    control = TrialProbe(cfg, probe.rng, probe.a, probe.a, probe.prefix_len, route=probe.route)
    control.prompts.like(probe.prompts)
    while result is None and len(own.shared) < cfg.design.max_per_arm:
        before = len(own.shared)
        n = cfg.salt_control_trials if not own.shared else cfg.design.batch
        for _ in range(n):
            control.trial(own, salt_a, salt_a)
        if own.cross_hits:
            break  # cached_tokens shows the hit directly
        if len(own.errors) > cfg.max_error_fraction * max(len(own.shared), 1) + 1:
            break
        result = test.add(own.shared[before:], own.fresh[before:])
    return own, result
