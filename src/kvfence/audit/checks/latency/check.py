"""Prefill latency: "latency that is too good" (INCIDENT.md, runbook signal 3).

A full prefill costs time roughly linear in the prompt length. A long prompt
answered in the time a short one takes was not prefilled: the engine reused
someone's KV (a cross-tenant cache hit) or replaced the prompt with a
placeholder (the Workers AI reject path). The check

1. times fresh random prompts (TTFT of a streaming ``max_tokens=1``
   completion) over a sweep of lengths up to the longest accepted prompt,
   several repeats each; every prompt is new random token ids, so no probe
   can legitimately hit any cache;
2. fits prefill cost vs length (Theil–Sen) on every length but the longest,
   labels each probe "fast" when it finished more than its tolerance
   (``max(k·σ_short, f·increment)``) under its predicted cost, and tests
   whether the long probes are fast more often than the shorter ones
   interleaved with them (one-sided exact p-value);
3. fails when p < alpha and the prefill cost is measurable above the noise;
4. is inconclusive when it is not measurable ("too fast" cannot be told from
   "fast"), when too few probes answered, or when the design could not reach
   alpha — the number of probes per length grows with −log alpha
   (`LatencyConfig.repeats_for`), so the runbook's sweep always can.

The analysis and its hypothesis test live in `analysis` (H0 "the
long prompts were prefilled", an exact one-sided p-value); request logs in
`log` (`kvfence audit latency --from-log`). This module is the live
check the runbook runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from kvfence.audit.base import CheckResult, JSONValue, Verdict
from kvfence.audit.checks.latency.analysis import (
    LatencyAnalysis,
    LatencyConfig,
    LatencySample,
    analyse,
    design_p_value,
)
from kvfence.audit.checks.latency.log import analyse_log, latency_command, parse_log_lines
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, Check
from kvfence.audit.targets.base import Target
from kvfence.audit.vocabulary import within_vocabulary

__all__ = [
    "LatencyAnalysis",
    "LatencyCheck",
    "LatencyConfig",
    "LatencySample",
    "analyse",
    "analyse_log",
    "design_p_value",
    "latency_command",
    "parse_log_lines",
]


class LatencyCheck(Check):
    """Live sweep: TTFT of fresh random prompts up to the longest accepted prompt."""

    name = "latency"
    description = (
        "no long prompt completes prefill faster than the engine's own prefill cost allows "
        "(TTFT vs length fit; exact test that the long prompts are not fast more often)"
    )

    def __init__(self, config: LatencyConfig | None = None) -> None:
        self.config = config or LatencyConfig()

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        client = ctx.client(target, "b")
        facts = target.facts(client)
        limit_fact = facts.input_limit(ctx.context_override)
        limit = limit_fact.as_int()
        if limit is None:
            return self.result(
                target,
                Verdict.INCONCLUSIVE,
                "longest accepted prompt unknown: cannot place the long bucket",
                {"input_limit": limit_fact.to_json()},
            )
        alpha = self.config.alpha if self.config.alpha is not None else ctx.alpha_for(self.name)
        level = alpha / self.config.sweeps  # each sweep is tested alone at its share
        ids = within_vocabulary(self.config.token_range, facts.vocab_size)
        cfg = replace(self.config, alpha=level, token_range=ids)
        lengths = cfg.sweep(limit)
        repeats = cfg.repeats_for(level)
        sweep, result, earlier = _decisive_sweep(ctx, client, cfg, lengths, repeats)
        evidence = result.evidence
        evidence["sweep"] = {"lengths": lengths, "repeats": repeats, "limit": limit_fact.to_json()}
        evidence["earlier_sweeps"] = earlier  # ambiguous ones, each replaced by a fresh sweep
        evidence["token_ids"] = {"range": list(ids), "vocab_size": facts.vocab_size.to_json()}
        evidence["alpha_per_sweep"] = level
        evidence["design_p_value"] = 2 * design_p_value(repeats, repeats, cfg.slack)
        evidence["errors"] = sweep.errors[:5]
        evidence["error_count"] = len(sweep.errors)
        evidence["usage_mismatches"] = sweep.mismatched
        verdict, summary = result.verdict, result.summary
        if earlier:
            first, p = earlier[0], earlier[0]["p_value"]
            shown = f"p = {p:.2g}" if isinstance(p, float) else "no p-value"
            summary = f"sweep {len(earlier) + 1} (sweep 1: {first['verdict']}, {shown}): {summary}"
        verdict, summary = _failed_probes(verdict, summary, sweep, len(lengths) * repeats, cfg)
        plots = [result.plot] if result.plot is not None else []
        out = self.result(target, verdict, summary, evidence, plots)
        # Bonferroni-adjusted over the sweeps the design allows: comparable with the check's alpha.
        p = result.p_value
        out.p_value, out.alpha = (None if p is None else min(1.0, p * cfg.sweeps)), alpha
        return out


def _failed_probes(
    verdict: Verdict, summary: str, sweep: Sweep, planned: int, cfg: LatencyConfig
) -> tuple[Verdict, str]:
    """Too many failed probes leave no verdict but a FAIL standing; the summary then says how
    many failed and what the engine said to the first."""
    if verdict is Verdict.FAIL or len(sweep.errors) <= cfg.max_error_fraction * planned:
        return verdict, summary
    first = sweep.errors[0].get("outcome")
    return (
        Verdict.INCONCLUSIVE,
        f"{len(sweep.errors)} of {planned} timing probes failed (first: {first}); {summary}",
    )


def _decisive_sweep(
    ctx: AuditContext, client: ProbeClient, cfg: LatencyConfig, lengths: list[int], repeats: int
) -> tuple[Sweep, LatencyAnalysis, list[dict[str, JSONValue]]]:
    """Fresh sweeps, each analysed alone at ``cfg.alpha`` (the check's alpha / sweeps), until
    one is not ambiguous or ``cfg.sweeps`` ran: (the last sweep, its analysis, the earlier)."""
    earlier: list[dict[str, JSONValue]] = []
    while True:
        sweep = _sweep(ctx, client, cfg, lengths, repeats)
        result = analyse(sweep.samples, cfg)
        if len(earlier) + 1 >= cfg.sweeps or not _ambiguous(result, cfg):
            return sweep, result, earlier
        earlier.append(
            {"verdict": result.verdict.value, "p_value": result.p_value, "summary": result.summary}
        )


def _ambiguous(result: LatencyAnalysis, cfg: LatencyConfig) -> bool:
    """Worth a fresh sweep: undecided, or a pass whose p-value leans towards a skip."""
    if result.verdict is Verdict.INCONCLUSIVE:
        return True
    p = result.p_value
    return result.verdict is Verdict.PASS and p is not None and p < cfg.recheck_below


@dataclass(slots=True)
class Sweep:
    samples: list[LatencySample] = field(default_factory=list)
    errors: list[dict[str, JSONValue]] = field(default_factory=list)
    mismatched: list[dict[str, JSONValue]] = field(default_factory=list)


def _sweep(
    ctx: AuditContext, client: ProbeClient, cfg: LatencyConfig, lengths: list[int], repeats: int
) -> Sweep:
    """Time ``repeats`` fresh prompts of every length, interleaved (drift hits all lengths)."""
    rng = random.Random(ctx.rng.random())
    lo, hi = cfg.token_range
    plan = [n for n in lengths for _ in range(repeats)]
    # Interleaved: drift cannot masquerade as a slope, and load hits long and reference
    # probes alike (the exchangeability the test's H0 rests on).
    rng.shuffle(plan)
    for _ in range(cfg.warmup):  # the first request pays one-off start-up costs
        client.ttft([rng.randrange(lo, hi) for _ in range(min(lengths))])
    out = Sweep()
    for i, n in enumerate(plan):
        r = client.ttft([rng.randrange(lo, hi) for _ in range(n)])
        if r.ok and r.ttft_s is not None:
            out.samples.append(LatencySample(n, r.ttft_s, "ttft", f"probe {i}: {n} tokens"))
            if r.prompt_tokens is not None and r.prompt_tokens != n and len(out.mismatched) < 5:
                out.mismatched.append({"sent": n, "usage_prompt_tokens": r.prompt_tokens})
        else:
            out.errors.append({"prompt_tokens": n, **r.brief()})
        ctx.progress("prefill latency sweep", (i + 1) / len(plan))
    return out
