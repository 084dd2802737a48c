"""Noninterference: tenant B's deterministic answers must not depend on A's traffic.

B sends a few fixed probes at temperature 0 (with logprobs where the target
gives them). First alone, repeated, to measure the engine's own baseline
nondeterminism (some engines are not batch-invariant even alone); then the
same number of repeats while tenant A keeps the engine busy with concurrent
requests. A repeat *diverges* when its generated tokens differ from the
probe's first answer alone. The check fails when the divergence rate under
load exceeds the baseline rate with significance (one-sided Fisher exact
test, `stats.divergence_excess`, pooled and per probe with a
Bonferroni split of alpha): an engine that reads another tenant's KV
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
from dataclasses import dataclass, field, replace
from typing import Any

from kvfence.audit.alpha import fisher_repeats_for
from kvfence.audit.base import AuditContext, Check, CheckResult, JSONValue, Verdict
from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.stats import divergence_excess
from kvfence.audit.targets.base import Target, TargetFacts


@dataclass(frozen=True, slots=True)
class NoninterferenceConfig:
    """Probe and load shape.

    ``probes`` distinct B prompts of ``probe_tokens`` tokens, each answered
    ``repeats`` times alone and ``repeats`` times under load;
    ``max_tokens`` generated per answer. With ``long_probe`` the last probe is
    long: just past the KV pool when the target's pool is smaller than its
    input limit (where the Workers AI reject path fired), else at the input
    limit but at most ``long_probe_cap`` tokens. A's load: ``load_concurrency``
    threads sending ``load_tokens``-token prompts (``load_max_tokens`` out).
    """

    probes: int = 4
    probe_tokens: int = 48
    max_tokens: int = 8
    repeats: int = 8
    long_probe: bool = True
    long_probe_cap: int = 1024
    logprobs: int = 1
    load_concurrency: int = 3
    load_tokens: int = 192
    load_max_tokens: int = 16
    alpha: float | None = None  # None: the audit's share (AuditContext.alpha_for)
    token_range: tuple[int, int] = (100, 500)

    def __post_init__(self) -> None:
        if min(self.probes, self.probe_tokens, self.max_tokens, self.repeats) < 1:
            raise ValueError("probes, probe_tokens, max_tokens and repeats must be >= 1")
        if self.load_concurrency < 1 or not 0 < (self.alpha or 0.5) < 1:
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
    per_probe: dict[int, list[int]] = field(default_factory=dict)  # probe -> [answers, diverged]

    def record(self, probe: int, ref: Answer, resp: ProbeResponse) -> None:
        if not resp.ok:
            self.errors.append(resp.brief())
            return
        got = answer_of(resp)
        self.total += 1
        counts = self.per_probe.setdefault(probe, [0, 0])
        counts[0] += 1
        if not got.same_output(ref):
            self.diverged += 1
            counts[1] += 1
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
            "per_probe": {
                str(k): {"answers": a, "diverged": d} for k, (a, d) in self.per_probe.items()
            },
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


def probe_lengths(
    cfg: NoninterferenceConfig, facts: TargetFacts, context_override: int | None
) -> tuple[list[int], str]:
    """B's probe lengths: short ones, plus one long probe where it matters."""
    lengths = [cfg.probe_tokens] * cfg.probes
    if not cfg.long_probe:
        return lengths, "short probes only"
    limit = facts.input_limit(context_override).as_int()
    if limit is None:
        return lengths, "input limit unknown: short probes only"
    top = limit - cfg.max_tokens
    pool = facts.pool_tokens.as_int()
    page = facts.page_size.as_int() or 1
    if pool is not None and pool + page <= top:
        # No cap here: a sound engine rejects this at the edge (cheap), and a
        # broken one answers it from a placeholder (cheap too).
        long, why = pool + page, f"one page past the KV pool ({pool} tokens)"
    else:
        long = min(top, cfg.long_probe_cap)
        why = f"at the input limit ({limit} tokens), cap {cfg.long_probe_cap}"
    if long <= cfg.probe_tokens:
        return lengths, "input limit too small for a long probe"
    lengths[-1] = long
    return lengths, f"last probe {long} tokens: {why}"


class NoninterferenceCheck(Check):
    name = "noninterference"
    description = (
        "tenant B's temperature-0 outputs do not change under tenant A's load beyond the "
        "engine's measured baseline nondeterminism (one-sided Fisher exact test)"
    )

    def __init__(self, config: NoninterferenceConfig | None = None) -> None:
        self.config = config or NoninterferenceConfig()

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        client_a, client_b = ctx.client(target, "a"), ctx.client(target, "b")
        target.facts(client_a)
        facts = target.facts(client_b)
        lengths, how = probe_lengths(self.config, facts, ctx.context_override)
        # The share of --alpha is split over len(lengths) + 1 tests; repeats grow until a
        # probe that diverges every time under load and never alone can reach it.
        alpha = self.config.alpha or ctx.alpha_for(self.name)
        repeats = fisher_repeats_for(alpha / (len(lengths) + 1), self.config.repeats)
        cfg = replace(self.config, alpha=alpha, repeats=repeats)
        rng = random.Random(ctx.rng.random())
        lo, hi = cfg.token_range
        all_prompts = [[rng.randrange(lo, hi) for _ in range(n)] for n in lengths]
        logprobs: int | None = cfg.logprobs

        def send(prompt: list[int]) -> ProbeResponse:
            return client_b.completion(
                prompt, max_tokens=cfg.max_tokens, temperature=0.0, logprobs=logprobs
            )

        first = send(all_prompts[0])
        if first.status == 400 and logprobs is not None:
            logprobs = None  # the target refuses logprobs: compare text and tokens only
            first = send(all_prompts[0])
        if not first.ok:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"B's probe failed alone (status {first.status}): nothing to compare",
                {"probe": first.brief()},
            )
        # A probe the target refuses (e.g. the long one on an undersized pool that
        # rejects at the edge, I4) has no reference answer: it is dropped, on record.
        prompts: list[list[int]] = [all_prompts[0]]
        refs = [answer_of(first)]
        dropped: list[dict[str, JSONValue]] = []
        for prompt in all_prompts[1:]:
            ref = send(prompt)
            if ref.ok:
                prompts.append(prompt)
                refs.append(answer_of(ref))
            else:
                dropped.append({"prompt_tokens": len(prompt), **ref.brief()})

        def ask(i: int) -> ProbeResponse:
            return send(prompts[i])

        probes = len(prompts)
        ctx.progress("noninterference: baseline", 0.0)
        alone = Tally()
        for rep in range(cfg.repeats):
            for i in range(probes):
                alone.record(i, refs[i], ask(i))
            ctx.progress("noninterference: baseline", (rep + 1) / cfg.repeats)
        load = _Load(client_a, cfg, rng)
        loaded = Tally()
        ctx.progress("noninterference: under load", 0.0)
        with ThreadPoolExecutor(max_workers=cfg.load_concurrency) as pool:
            futures = [pool.submit(load.worker, s) for s in load.seeds]
            try:
                for rep in range(cfg.repeats):
                    for i in range(probes):
                        loaded.record(i, refs[i], ask(i))
                    ctx.progress("noninterference: under load", (rep + 1) / cfg.repeats)
            finally:
                load.stop.set()
            for f in futures:
                f.result()  # a crashed load worker is a crashed check (fail closed)
        result = self._verdict(target, cfg, alone, loaded, load, logprobs is not None)
        result.evidence["probe_tokens"] = [len(p) for p in prompts]
        result.evidence["probe_lengths_from"] = how
        result.evidence["dropped_probes"] = dropped
        result.alpha, p = alpha, result.evidence.get("p_value")
        result.p_value = p if isinstance(p, float) else None
        return result

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
        # One pooled test plus one per probe (interference may hit only the long
        # probe); Bonferroni keeps the family's false-alarm rate at alpha.
        probes = sorted(alone.per_probe.keys() & loaded.per_probe.keys())
        alpha = cfg.alpha or 0.0  # set by run()
        per_test_alpha = alpha / (len(probes) + 1)
        pooled = divergence_excess(alone.diverged, alone.total, loaded.diverged, loaded.total)
        per_probe = {
            i: divergence_excess(
                alone.per_probe[i][1],
                alone.per_probe[i][0],
                loaded.per_probe[i][1],
                loaded.per_probe[i][0],
            )
            for i in probes
        }
        evidence["fisher_p_value"] = pooled.p_value
        evidence["fisher_p_value_per_probe"] = {str(i): t.p_value for i, t in per_probe.items()}
        evidence["alpha"] = alpha
        evidence["alpha_per_test"] = per_test_alpha
        rates = (
            f"divergence alone {alone.diverged}/{alone.total}, under A's load "
            f"{loaded.diverged}/{loaded.total} ({load.ok} A requests)"
        )
        hits = [(-1, pooled), *per_probe.items()]
        worst_i, worst_t = min(hits, key=lambda it: it[1].p_value)
        evidence["p_value"] = min(1.0, worst_t.p_value * len(hits))  # Bonferroni-adjusted
        if worst_t.p_value < per_test_alpha:
            where = "all probes" if worst_i < 0 else f"probe {worst_i}"
            return self.result(
                target,
                Verdict.FAIL,
                f"B's output depends on A's traffic ({where}: {worst_t.load_diverged}/"
                f"{worst_t.load_total} under load vs {worst_t.baseline_diverged}/"
                f"{worst_t.baseline_total} alone, Fisher p = {worst_t.p_value:.2e} < "
                f"{per_test_alpha:.1e}); {rates}",
                evidence,
            )
        # A probe that changes on most repeats *alone* leaves no room to see
        # interference: the test has no power on it, so it cannot vouch (fail closed).
        unstable = [i for i, (a, d) in alone.per_probe.items() if a >= 2 and 2 * d >= a]
        if unstable:
            evidence["unstable_alone"] = unstable
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"probe(s) {unstable} are not deterministic even alone at temperature 0, so "
                f"interference cannot be measured on them; {rates}",
                evidence,
            )
        note = f"; max logprob delta {loaded.max_logprob_delta:.2e}" if with_logprobs else ""
        return self.result(
            target,
            Verdict.PASS,
            f"no interference beyond baseline: {rates}; smallest Fisher p = "
            f"{worst_t.p_value:.2g}{note}",
            evidence,
        )
