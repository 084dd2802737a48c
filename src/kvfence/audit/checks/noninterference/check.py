"""Noninterference: tenant B's deterministic answers must not depend on A's traffic.

B sends a few fixed probes at temperature 0 (with logprobs where the target
gives them). First alone, repeated, to measure the engine's own baseline
nondeterminism (some engines are not batch-invariant even alone); then the
same number of repeats while tenant A keeps the engine busy with concurrent
requests, each repeat sent only once an A request that began after B's
previous answer has ended (A's pages were taken, written and released in
between: `probes.Load`). A repeat *diverges* when its generated tokens differ from the
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
from dataclasses import replace

from kvfence.audit.alpha import fisher_repeats_for
from kvfence.audit.base import CheckResult, JSONValue, Verdict
from kvfence.audit.checks.noninterference.curtail import decided
from kvfence.audit.checks.noninterference.probes import Load, NoninterferenceConfig, Probes, Tally
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.stats import DivergenceTest, divergence_excess
from kvfence.audit.targets.base import Target, TargetFacts
from kvfence.audit.vocabulary import within_vocabulary

NONINTERFERENCE_MISSES = 1  # divergent load repeats a leak may miss and still be caught

__all__ = ["NoninterferenceCheck", "NoninterferenceConfig", "probe_lengths"]


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
        """B's references -> B's repeats alone -> B's repeats under A's load -> Fisher test."""
        client_a, client_b = (ctx.client(target, t, paced=True) for t in ("a", "b"))
        target.facts(client_a)
        facts = target.facts(client_b)
        lengths, how = probe_lengths(self.config, facts, ctx.context_override)
        cfg = self._sized(ctx, facts, len(lengths))
        rng = random.Random(ctx.rng.random())
        lo, hi = cfg.token_range
        all_prompts = [[rng.randrange(lo, hi) for _ in range(n)] for n in lengths]
        probes = Probes(client_b, cfg, cfg.logprobs)
        first = probes.first(all_prompts[0])
        if not first.ok:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                f"B's probe failed alone ({first.outcome()}): nothing to compare",
                {"probe": first.brief()},
            )
        probes.references(all_prompts[1:])
        alone = probes.tally(ctx, "noninterference: baseline")
        load = Load(client_a, cfg, rng)
        alpha = cfg.alpha or 0.0  # set by _sized

        def stop(tally: Tally, rounds_left: int) -> str | None:
            return decided(alpha, alone, tally, rounds_left)

        loaded = probes.under_load(ctx, load, stop)
        result = self._verdict(target, cfg, alone, loaded, load, probes.logprobs is not None)
        result.evidence["probe_tokens"] = [len(p) for p in probes.prompts]
        result.evidence["probe_lengths_from"] = how
        result.evidence["dropped_probes"] = probes.dropped
        ids = {"range": list(cfg.token_range), "vocab_size": facts.vocab_size.to_json()}
        result.evidence["token_ids"] = ids
        result.alpha, p = cfg.alpha, result.evidence.get("p_value")
        result.p_value = p if isinstance(p, float) else None
        return result

    def _sized(self, ctx: AuditContext, facts: TargetFacts, probes: int) -> NoninterferenceConfig:
        """The config at the audit's alpha share, with the repeats that share needs, drawing
        token ids inside the target's vocabulary.

        The share of --alpha is split over probes + 1 tests; repeats grow until a probe that
        diverges on all but one repeat under load and never alone reaches it: a single load
        repeat that misses A's page turnover must not hide a leak (the lab came out 8/9 on a
        loaded machine, a pass, when one missed was the limit)."""
        alpha = self.config.alpha or ctx.alpha_for(self.name)
        repeats = fisher_repeats_for(
            alpha / (probes + 1), self.config.repeats, misses=NONINTERFERENCE_MISSES
        )
        ids = within_vocabulary(self.config.token_range, facts.vocab_size)
        return replace(self.config, alpha=alpha, repeats=repeats, token_range=ids)

    def _verdict(
        self,
        target: Target,
        cfg: NoninterferenceConfig,
        alone: Tally,
        loaded: Tally,
        load: Load,
        with_logprobs: bool,
    ) -> CheckResult:
        evidence: dict[str, JSONValue] = {
            "repeats": cfg.repeats,
            "logprobs": with_logprobs,
            "baseline": alone.to_json(),
            "under_load": loaded.to_json(),
            "load": load.to_json(),
        }
        untested = _untested(alone, loaded, load)
        if untested is not None:
            return self.result(target, Verdict.INCONCLUSIVE, untested, evidence)
        worst_i, worst_t, per_test_alpha = _fisher(cfg, alone, loaded, evidence)
        rates = _rates(alone, loaded, load, cfg.repeats)
        if worst_t.p_value < per_test_alpha:
            why = _depends(worst_i, worst_t, per_test_alpha)
            return self.result(target, Verdict.FAIL, f"{why}; {rates}", evidence)
        unstable = _unstable_alone(alone)
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


def _rates(alone: Tally, loaded: Tally, load: Load, repeats: int) -> str:
    rates = (
        f"divergence alone {alone.diverged}/{alone.total}, under A's load "
        f"{loaded.diverged}/{loaded.total} ({load.ok} A requests)"
    )
    if loaded.stopped_early is None:
        return rates
    return f"{rates}; stopped after {loaded.rounds} of {repeats} rounds under load: " + (
        loaded.stopped_early
    )


def _depends(probe: int, test: DivergenceTest, alpha: float) -> str:
    where = "all probes" if probe < 0 else f"probe {probe}"
    return (
        f"B's output depends on A's traffic ({where}: {test.load_diverged}/"
        f"{test.load_total} under load vs {test.baseline_diverged}/"
        f"{test.baseline_total} alone, Fisher p = {test.p_value:.2e} < {alpha:.1e})"
    )


def _untested(alone: Tally, loaded: Tally, load: Load) -> str | None:
    """Why there is nothing to compare, or None."""
    if alone.total == 0 or loaded.total == 0:
        return "B's probes failed: no answers to compare"
    if load.ok == 0:
        return f"tenant A's load never succeeded ({load.sent} requests): no interference tested"
    return None


def _unstable_alone(alone: Tally) -> list[int]:
    """Probes that change on most repeats *alone*: that leaves no room to see interference;
    the test has no power on them, so it cannot vouch (fail closed)."""
    return [i for i, (a, d) in alone.per_probe.items() if a >= 2 and 2 * d >= a]


def _fisher(
    cfg: NoninterferenceConfig, alone: Tally, loaded: Tally, evidence: dict[str, JSONValue]
) -> tuple[int, DivergenceTest, float]:
    """(the probe with the smallest p (-1: pooled), its test, the per-test alpha), on record."""
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
    hits = [(-1, pooled), *per_probe.items()]
    worst_i, worst_t = min(hits, key=lambda it: it[1].p_value)
    evidence["p_value"] = min(1.0, worst_t.p_value * len(hits))  # Bonferroni-adjusted
    return worst_i, worst_t, per_test_alpha
