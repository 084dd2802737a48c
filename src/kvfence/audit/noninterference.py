"""Noninterference: tenant B's deterministic answers must not depend on A's traffic.

B sends a few fixed probes at temperature 0 (with logprobs where the target
gives them). First alone, repeated, to measure the engine's own baseline
nondeterminism (some engines are not batch-invariant even alone); then the
same number of repeats while tenant A keeps the engine busy with concurrent
requests. A repeat *diverges* when its generated tokens differ from the
probe's first answer alone. The check fails when the divergence rate under
load exceeds the baseline rate with significance (one-sided Fisher exact
test, `stats.divergence_excess`): an engine that reads another tenant's KV
(a stale page, a cross-tenant cache hit) changes B's output exactly when A's
data is around.

Logprob differences are reported (the largest absolute delta of a chosen
token's logprob) but do not count as divergence on their own: engines whose
kernels are not batch-invariant legitimately move logprobs by float rounding
when the batch changes (Thinking Machines, 2025), without any leak.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvfence.audit.base import AuditContext, Check, CheckResult, JSONValue, Verdict
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.stats import divergence_excess
from kvfence.audit.targets.base import Target


@dataclass(frozen=True, slots=True)
class NoninterferenceConfig:
    """Probe and load shape.

    ``probes`` distinct B prompts of ``probe_tokens`` tokens, each answered
    ``repeats`` times alone and ``repeats`` times under load;
    ``max_tokens`` generated per answer. A's load: ``load_concurrency``
    threads sending ``load_tokens``-token prompts (``load_max_tokens`` out).
    """

    probes: int = 4
    probe_tokens: int = 48
    max_tokens: int = 8
    repeats: int = 6
    logprobs: int = 1
    load_concurrency: int = 3
    load_tokens: int = 192
    load_max_tokens: int = 16
    alpha: float = 1e-3
    token_range: tuple[int, int] = (100, 500)

    def __post_init__(self) -> None:
        if min(self.probes, self.probe_tokens, self.max_tokens, self.repeats) < 1:
            raise ValueError("probes, probe_tokens, max_tokens and repeats must be >= 1")
        if self.load_concurrency < 1 or not 0 < self.alpha < 1:
            raise ValueError("need load_concurrency >= 1 and 0 < alpha < 1")


@dataclass(frozen=True, slots=True)
class Answer:
    """What a temperature-0 answer is compared on."""

    tokens: tuple[Any, ...]  # generated tokens (ids or strings, as the server reports them)
    text: str
    logprobs: tuple[float, ...]

    def same_output(self, other: Answer) -> bool:
        return self.text == other.text and self.tokens == other.tokens

    def max_logprob_delta(self, other: Answer) -> float | None:
        n = min(len(self.logprobs), len(other.logprobs))
        if n == 0 or not self.same_output(other):
            return None
        return max(abs(a - b) for a, b in zip(self.logprobs[:n], other.logprobs[:n], strict=True))


def answer_of(resp: ProbeResponse) -> Answer:
    """Tokens and chosen-token logprobs in the completion or the chat shape."""
    lp = resp.logprobs
    tokens: list[Any] = []
    values: list[float] = []
    if isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):
        tokens = list(lp.get("tokens") or [])
        values = [float(v) for v in lp["token_logprobs"] if isinstance(v, int | float)]
    elif isinstance(lp, dict) and isinstance(lp.get("content"), list):
        for item in lp["content"]:
            if isinstance(item, dict):
                tokens.append(item.get("id", item.get("token")))
                v = item.get("logprob")
                if isinstance(v, int | float):
                    values.append(float(v))
    return Answer(tuple(tokens), resp.text, tuple(values))


@dataclass(slots=True)
class Tally:
    """Divergences of one phase (alone or under load)."""

    total: int = 0
    diverged: int = 0
    max_logprob_delta: float = 0.0
    examples: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def record(self, probe: int, ref: Answer, resp: ProbeResponse) -> None:
        if not resp.ok:
            self.errors.append(resp.brief())
            return
        got = answer_of(resp)
        self.total += 1
        if not got.same_output(ref):
            self.diverged += 1
            if len(self.examples) < 3:
                self.examples.append(
                    {
                        "probe": probe,
                        "reference_text": ref.text,
                        "reference_tokens": list(ref.tokens),
                        "got_text": got.text,
                        "got_tokens": list(got.tokens),
                        "response": resp.brief(),
                    }
                )
            return
        delta = got.max_logprob_delta(ref)
        if delta is not None:
            self.max_logprob_delta = max(self.max_logprob_delta, delta)

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "answers": self.total,
            "diverged": self.diverged,
            "rate": self.diverged / self.total if self.total else None,
            "max_logprob_delta": self.max_logprob_delta,
            "examples": self.examples,
            "errors": self.errors[:3],
            "error_count": len(self.errors),
        }


class _Load:
    """Tenant A's concurrent traffic while B probes; stops when told."""

    def __init__(self, client: ProbeClient, cfg: NoninterferenceConfig, rng: random.Random) -> None:
        self.client, self.cfg = client, cfg
        self.seeds = [rng.getrandbits(32) for _ in range(cfg.load_concurrency)]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.ok = 0
        self.failures: list[dict[str, Any]] = []

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        lo, hi = self.cfg.token_range
        while not self.stop.is_set():
            prompt = [rng.randrange(lo, hi) for _ in range(self.cfg.load_tokens)]
            r = self.client.completion(prompt, max_tokens=self.cfg.load_max_tokens, temperature=1.0)
            with self.lock:
                self.sent += 1
                if r.ok:
                    self.ok += 1
                elif len(self.failures) < 3:
                    self.failures.append(r.brief())

    def to_json(self) -> dict[str, JSONValue]:
        return {"sent": self.sent, "ok": self.ok, "failures": self.failures}


class NoninterferenceCheck(Check):
    name = "noninterference"
    description = (
        "tenant B's temperature-0 outputs do not change under tenant A's load beyond the "
        "engine's measured baseline nondeterminism (one-sided Fisher exact test)"
    )

    def __init__(self, config: NoninterferenceConfig | None = None) -> None:
        self.config = config or NoninterferenceConfig()

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        cfg = self.config
        client_a, client_b = ctx.client(target, "a"), ctx.client(target, "b")
        target.facts(client_a)
        target.facts(client_b)
        rng = random.Random(ctx.rng.random())
        lo, hi = cfg.token_range
        prompts = [
            [rng.randrange(lo, hi) for _ in range(cfg.probe_tokens)] for _ in range(cfg.probes)
        ]
        logprobs: int | None = cfg.logprobs

        def ask(i: int) -> ProbeResponse:
            return client_b.completion(
                prompts[i], max_tokens=cfg.max_tokens, temperature=0.0, logprobs=logprobs
            )

        first = ask(0)
        if first.status == 400 and logprobs is not None:
            logprobs = None  # the target refuses logprobs: compare text and tokens only
            first = ask(0)
        if not first.ok:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"B's probe failed alone (status {first.status}): nothing to compare",
                {"probe": first.brief()},
            )
        refs = [answer_of(first)] + [answer_of(ask(i)) for i in range(1, cfg.probes)]
        ctx.progress("noninterference: baseline", 0.0)
        alone = Tally()
        for r in range(cfg.repeats):
            for i in range(cfg.probes):
                alone.record(i, refs[i], ask(i))
            ctx.progress("noninterference: baseline", (r + 1) / cfg.repeats)
        load = _Load(client_a, cfg, rng)
        loaded = Tally()
        ctx.progress("noninterference: under load", 0.0)
        with ThreadPoolExecutor(max_workers=cfg.load_concurrency) as pool:
            futures = [pool.submit(load.worker, s) for s in load.seeds]
            try:
                for r in range(cfg.repeats):
                    for i in range(cfg.probes):
                        loaded.record(i, refs[i], ask(i))
                    ctx.progress("noninterference: under load", (r + 1) / cfg.repeats)
            finally:
                load.stop.set()
            for f in futures:
                f.result()  # a crashed load worker is a crashed check (fail closed)
        return self._verdict(target, cfg, alone, loaded, load, logprobs is not None)

    def _verdict(
        self,
        target: Target,
        cfg: NoninterferenceConfig,
        alone: Tally,
        loaded: Tally,
        load: _Load,
        with_logprobs: bool,
    ) -> CheckResult:
        evidence: dict[str, JSONValue] = {
            "probes": cfg.probes,
            "repeats": cfg.repeats,
            "logprobs": with_logprobs,
            "baseline": alone.to_json(),
            "under_load": loaded.to_json(),
            "load": load.to_json(),
        }
        if alone.total == 0 or loaded.total == 0:
            return self.result(
                target, Verdict.INCONCLUSIVE, "B's probes failed: no answers to compare", evidence
            )
        if load.ok == 0:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"tenant A's load never succeeded ({load.sent} requests): no interference tested",
                evidence,
            )
        test = divergence_excess(alone.diverged, alone.total, loaded.diverged, loaded.total)
        evidence["fisher_p_value"] = test.p_value
        evidence["alpha"] = cfg.alpha
        rates = (
            f"divergence alone {alone.diverged}/{alone.total}, under A's load "
            f"{loaded.diverged}/{loaded.total} ({load.ok} A requests)"
        )
        if test.p_value < cfg.alpha:
            return self.result(
                target,
                Verdict.FAIL,
                f"B's output depends on A's traffic: {rates}; Fisher p = {test.p_value:.2e}",
                evidence,
            )
        note = f"; max logprob delta {loaded.max_logprob_delta:.2e}" if with_logprobs else ""
        return self.result(
            target,
            Verdict.PASS,
            f"no interference beyond baseline: {rates}; Fisher p = {test.p_value:.2f}{note}",
            evidence,
        )
