"""Prefix sharing: can tenant B detect tenant A's cached prefix? (Gu et al., ICML 2025)

Attack model (CVE-2025-46570): a prefix cache shared across tenants answers a
request faster when someone already sent its prefix, so B learns what A sent
by timing. Isolation (I8) namespaces the cache per tenant (and per
``cache_salt``), so B's requests never find A's pages.

One trial (all prompts are fresh random token ids, so nothing but A's warm-up
can put them in any cache):

1. A sends ``P + s_A`` (P: a random prefix of several pages; s_A: a random
   suffix), ``max_tokens=1`` — A's KV for P is now cached if anything is;
2. B sends ``P + s_B`` (shared arm) and ``Q + s_B'`` with a fresh random Q
   of the same length (fresh arm), in random order, timing each TTFT.

A one-sided KS test asks whether the shared arm is stochastically faster; it
runs as a group-sequential test (`stats.SequentialKS`: Bonferroni-split alpha
over the planned looks), so a leaking cache is proven with a few dozen
requests and an isolating one is passed only after the full budget, with
the KS distance it could have detected stated in the evidence.

When the engine reports ``usage.prompt_tokens_details.cached_tokens``, a
shared-arm answer that reports more cached tokens than any fresh-arm answer
is direct evidence of a cross-tenant hit.

With ``cache_salt`` (when the target accepts it) a second, salted run gives
A and B different salts and must show no leak, AND a same-salt control (A
re-reading its own prefix with its own salt) must hit: a salt test that only
sees misses also passes with caching switched off, so without an observed
hit the salted verdict is inconclusive, never pass.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from kvfence.audit import premises
from kvfence.audit.alpha import evidence_scale, sequential_design_for
from kvfence.audit.base import CheckResult, Fact, JSONValue, Plot, PlotSeries, Verdict, worst
from kvfence.audit.checks.prefix_sharing.salt_routes import dropped_routes, salt_route_run
from kvfence.audit.checks.prefix_sharing.trials import (
    Arms,
    PrefixSharingConfig,
    TrialProbe,
    run_arms,
    same_salt_trials,
)
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.stats import SequentialResult
from kvfence.audit.targets.base import Target, TargetFacts
from kvfence.audit.vocabulary import within_vocabulary

__all__ = ["Arms", "PrefixSharingCheck", "PrefixSharingConfig", "judge", "prefix_length"]


class PrefixSharingCheck(Check):
    name = "prefix_sharing"
    description = (
        "tenant B cannot detect tenant A's cached prefix by timing (one-sided sequential KS) "
        "or by cached_tokens; cache_salt: same salt hits and different salt misses"
    )

    def __init__(
        self, config: PrefixSharingConfig | None = None, *, audit_alpha: bool | None = None
    ) -> None:
        """`audit_alpha`: size the design from the audit's `--alpha` share (default: only when
        no config is given; an explicit design keeps its alpha)."""
        self.config = config or PrefixSharingConfig()
        self.own_alpha = config is not None if audit_alpha is None else not audit_alpha

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        client_a, client_b = (ctx.client(target, t, paced=True) for t in ("a", "b"))
        facts = target.facts(client_a)
        target.facts(client_b)
        rng = random.Random(ctx.rng.random())
        cache, salt = premises.prefix_cache(facts), premises.salt_support(facts)
        runs, not_run = premises.prefix_runs(self.config.salt, cache, salt, rng)
        dropped, _ = dropped_routes(facts)
        on = dropped is not None and self.config.salt != "off"
        routes = self.config.salt_routes if on else ()
        cfg, scale = self._sized(ctx, len(runs) + len(routes), facts)
        prefix_len, how = prefix_length(cfg, facts, ctx.context_override, scale)
        if prefix_len is None:
            return self.result(target, Verdict.INCONCLUSIVE, how, {"facts": facts.to_json()})
        probe = TrialProbe(cfg, rng, client_a, client_b, prefix_len)
        evidence: dict[str, JSONValue] = {
            "prefix_tokens": prefix_len,
            "prefix_length_from": how,
            "prefix_evidence_scale": scale,
            "design": _design(cfg),
            "cache_salt_supported": facts.cache_salt_supported.to_json(),
            "premises": [cache.to_json(), salt.to_json()],
            "not_run": dict(not_run),
        }
        verdicts: list[Verdict] = []
        summaries: list[str] = []
        plots: list[Plot] = []
        for label, salt_a, salt_b in runs:
            v, s, plot = self._one_run(ctx, cfg, probe, cache, (label, salt_a, salt_b), evidence)
            verdicts.append(v)
            summaries.append(f"{label}: {s}")
            plots.append(plot)
        extra = _salt_routes(ctx, cfg, probe, (routes, dropped), evidence)  # after: prompts decided
        verdicts += [Verdict(e["verdict"]) for e in extra.values()]
        summaries += [f"salt within a tenant, {e['summary']}" for e in extra.values()]
        summaries += [f"{label}: not run — {why}" for label, why in not_run.items()]
        ran = [evidence[k] for k in ("unsalted", "salted") if k in evidence]
        evidence["requests"] = sum(int(e["requests"]) for e in [*ran, *extra.values()])
        evidence["prompts"] = probe.prompts.described()
        out = self.result(target, worst(verdicts), "; ".join(summaries), evidence, plots)
        return _with_alpha(out, ran, cfg, len(runs) + len(routes))

    def _sized(
        self, ctx: AuditContext, n_runs: int, facts: TargetFacts
    ) -> tuple[PrefixSharingConfig, float]:
        """The audit's share, split over the runs, in a design that can reach it, drawing token
        ids inside the target's vocabulary; and the factor the prefix grows by for that level
        (`alpha.evidence_scale`)."""
        ids = within_vocabulary(self.config.token_range, facts.vocab_size)
        cfg = replace(self.config, token_range=ids)
        if not self.own_alpha:  # an explicit design keeps its alpha
            share = ctx.alpha_for(self.name) / max(1, n_runs)
            cfg = replace(cfg, design=sequential_design_for(cfg.design, share))
        return cfg, evidence_scale(cfg.design, self.config.design)

    def _one_run(
        self,
        ctx: AuditContext,
        cfg: PrefixSharingConfig,
        probe: TrialProbe,
        cache: premises.Premise,
        run: tuple[str, str | None, str | None],
        evidence: dict[str, JSONValue],
    ) -> tuple[Verdict, str, Plot]:
        """One run (unsalted or salted): trials -> verdict, its evidence under its label."""
        label, salt_a, salt_b = run
        ctx.progress(f"prefix sharing ({label})", 0.0)
        arms, seq = run_arms(probe, cfg, salt_a, salt_b, _progress(ctx, label))
        v, s, ev = judge(arms, seq, cfg)
        if label == "salted" and v is Verdict.PASS:
            v, s, control = self._salt_control(probe, arms, salt_a, cfg, cache)
            ev["same_salt_control"] = control
        if v is Verdict.FAIL and cache.absent:
            s = f"the engine states it has no prefix cache ({cache.stated()}), yet {s}"
            evidence["premise_contradicted"] = cache.to_json()
        ev["verdict"] = v.value
        evidence[label] = ev
        return v, s, _hist(label, arms)

    def _salt_control(
        self,
        probe: TrialProbe,
        arms: Arms,
        salt_a: str | None,
        cfg: PrefixSharingConfig,
        cache: premises.Premise,
    ) -> tuple[Verdict, str, dict[str, JSONValue]]:
        """Same tenant, same salt must hit, else the salted pass proves nothing."""
        own, result = same_salt_trials(probe, salt_a, cfg)
        hit_seen = bool(own.cross_hits) or (result is not None and result.rejected)
        info: dict[str, JSONValue] = {
            "requests": own.requests,
            "hit_by_cached_tokens": bool(own.cross_hits),
            "hit_by_timing_p": result.p_value if result is not None else None,
        }
        if hit_seen:
            return (
                Verdict.PASS,
                f"different salts isolate (no leak in {arms.requests} requests) and the same "
                f"salt hits ({own.requests} control requests)",
                info,
            )
        if cache.absent:
            # The control cannot hit without a cache: its miss is the stated fact, confirmed.
            return (
                Verdict.PASS,
                f"no leak across salts in {arms.requests} requests; the same salt never hit "
                f"either, as stated: "
                + cache.decided("there is no cached prefix for a salt to isolate"),
                info,
            )
        return (
            Verdict.INCONCLUSIVE,
            "no leak across salts, but the same salt never hit either: caching may be off, "
            "so salt isolation is not shown",
            info,
        )


def _with_alpha(
    out: CheckResult, ran: list[JSONValue], cfg: PrefixSharingConfig, n_runs: int
) -> CheckResult:
    """The check's p-value and alpha: Bonferroni over the runs that split its share."""
    n = max(1, n_runs)
    adjusted = [e["ks"]["adjusted_p_value"] for e in ran if isinstance(e, dict) and "ks" in e]
    out.p_value = min(1.0, min(adjusted) * n) if adjusted else None
    out.alpha = cfg.design.alpha * n
    return out


def _salt_routes(
    ctx: AuditContext,
    cfg: PrefixSharingConfig,
    probe: TrialProbe,
    stated: tuple[tuple[str, ...], Fact | None],
    evidence: dict[str, JSONValue],
) -> dict[str, dict[str, JSONValue]]:
    """Tenant A's own salts on each route, where a route is stated to drop the salt."""
    routes, dropped = stated
    by_route: dict[str, dict[str, JSONValue]] = {}
    if dropped is None or not routes:
        return by_route
    for route in routes:
        ctx.progress(f"prefix sharing (salt within a tenant, {route})", 0.0)
        v, s, ev = salt_route_run(
            cfg, probe.rng, probe.a, probe.prefix_len, probe.prompts, route, dropped
        )
        by_route[route] = {**ev, "verdict": v.value, "summary": s}
    evidence["salt_within_tenant"] = dict(by_route)
    evidence["cache_salt_dropped_on"] = dropped.to_json()
    return by_route


def _design(cfg: PrefixSharingConfig) -> dict[str, JSONValue]:
    return {
        "alpha": cfg.design.alpha,
        "alpha_per_look": cfg.design.alpha_per_look,
        "trials_per_look": cfg.design.batch,
        "max_trials": cfg.design.max_per_arm,
        "error_control": "Bonferroni split of alpha over the planned looks",
    }


def _progress(ctx: AuditContext, label: str) -> Callable[[float], None]:
    def report(fraction: float) -> None:
        ctx.progress(f"prefix sharing ({label})", fraction)

    return report


def prefix_length(
    cfg: PrefixSharingConfig,
    facts: TargetFacts,
    context_override: int | None,
    scale: float = 1.0,
) -> tuple[int | None, str]:
    """Prefix tokens: several whole pages (`scale` times the configured ones, for a stricter
    level: `alpha.evidence_scale`), within the longest accepted prompt."""
    page = facts.page_size.as_int()
    page_src = facts.page_size.source if page else f"default page {cfg.default_page}"
    page = page or cfg.default_page
    times = max(1, int(scale))  # whole multiples: a level near the default's keeps its prompts
    want = max(cfg.prefix_pages * page, cfg.min_prefix_tokens) * times
    want = -(-want // page) * page  # whole pages: caches share whole pages only
    limit = facts.input_limit(context_override).as_int()
    if limit is None:
        return None, "longest accepted prompt unknown: cannot size the prefix"
    room = limit - cfg.suffix_tokens
    if room < page:
        return None, f"longest accepted prompt {limit} is shorter than one page ({page})"
    if want > room:
        want = (room // page) * page
    grown = f", {times} x the default's for the level asked" if times > 1 else ""
    return want, f"{want // page} pages of {page} tokens ({page_src}{grown}); limit {limit}"


def judge(
    arms: Arms, seq: SequentialResult | None, cfg: PrefixSharingConfig
) -> tuple[Verdict, str, dict[str, JSONValue]]:
    """Verdict of one run from its timings, cached-token evidence and errors."""
    ev = _run_evidence(arms, seq)
    if arms.cross_hits:
        hit = arms.cross_hits[0]
        return (
            Verdict.FAIL,
            f"B's request reported {hit['cached_tokens']} cached tokens of A's prefix "
            f"({len(arms.cross_hits)} cross-tenant hit(s) in {arms.requests} requests)",
            ev,
        )
    if seq is not None and seq.rejected:
        return (
            Verdict.FAIL,
            f"B detects A's cached prefix by timing: one-sided KS p = {seq.p_value:.2e} "
            f"< {seq.threshold:.1e} after {arms.requests} requests",
            ev,
        )
    if seq is None or len(arms.errors) > cfg.max_error_fraction * max(len(arms.shared), 1):
        first = arms.errors[0] if arms.errors else {}
        return (
            Verdict.INCONCLUSIVE,
            f"{len(arms.errors)} of {len(arms.shared) + len(arms.errors)} trials failed "
            f"(first: {first.get('outcome') or 'none recorded'})",
            ev,
        )
    return (
        Verdict.PASS,
        f"no detectable cross-tenant prefix reuse in {arms.requests} requests "
        f"(KS p = {seq.p_value:.2f}; a KS distance >= {seq.detectable_distance:.2f} "
        f"would have been detected)",
        ev,
    )


def _run_evidence(arms: Arms, seq: SequentialResult | None) -> dict[str, JSONValue]:
    ev: dict[str, JSONValue] = {
        "requests": arms.requests,
        "trials": len(arms.shared),
        "errors": arms.errors[:5],
        "error_count": len(arms.errors),
        "cached_tokens_reported": arms.cached_reported,
        "cross_tenant_cached_hits": len(arms.cross_hits),
        "cross_tenant_hit_examples": arms.cross_hits[:3],
        "shared_ttft_s": arms.shared,
        "fresh_ttft_s": arms.fresh,
    }
    if seq is not None:
        ev["ks"] = {
            "p_value": seq.p_value,
            "threshold_per_look": seq.threshold,
            "adjusted_p_value": seq.adjusted_p_value,
            "statistic": seq.looks[-1].statistic if seq.looks else None,
            "looks": [[lk.n_per_arm, lk.p_value] for lk in seq.looks],
            "rejected": seq.rejected,
            "detectable_ks_distance": seq.detectable_distance,
        }
    return ev


def _hist(label: str, arms: Arms) -> Plot:
    return Plot(
        kind="hist",
        title=f"B's TTFT: shared prefix vs fresh prefix ({label})",
        x_label="seconds",
        series=[
            PlotSeries("shared with A (possible hit)", x=list(arms.shared), style="hist"),
            PlotSeries("fresh (miss)", x=list(arms.fresh), style="hist"),
        ],
        note="a leak shows as the shared distribution shifted left of the fresh one",
    )
