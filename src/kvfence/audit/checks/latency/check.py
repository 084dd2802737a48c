"""Prefill latency: "latency that is too good" (INCIDENT.md, runbook signal 3).

A full prefill costs time roughly linear in the prompt length. A long prompt
answered in the time a short one takes was not prefilled: the engine reused
someone's KV (a cross-tenant cache hit) or replaced the prompt with a
placeholder (the Workers AI reject path). The check

1. times a short warm-up at the lengths it compares (`pilot`: where the
   cost jumps, and what the sweep will cost: one the audit's time cannot pay
   is refused before it starts), then fresh random prompts (TTFT of a
   streaming ``max_tokens=1`` completion) over a sweep of lengths up to the
   longest accepted prompt, several repeats each; every prompt is new random
   token ids, so no probe can legitimately hit any cache;
2. labels each probe "fast" when it finished under a floor a skip would put
   it below, and tests whether the long probes are fast more often than their
   neighbours interleaved with them (one-sided exact p-value; `analysis`);
3. fails when p < alpha and the prefill cost is measurable: this sweep would
   have failed a skip (the same test with short probes' times in the long
   bucket);
4. is inconclusive when it is not measurable ("too fast" cannot be told from
   "fast"), when too few probes answered, or when the design could not reach
   alpha — the number of probes per length grows with −log alpha until a
   sweep can vouch for a pass with a few probes slowed by load
   (`LatencyConfig.sweep_repeats`), so the runbook's sweep always can.

The analysis and its hypothesis test live in `analysis` (H0 "the
long prompts were prefilled", an exact one-sided p-value); request logs in
`log` (`kvfence audit latency --from-log`). This module is the live
check the runbook runs.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace

from kvfence.audit.base import CheckResult, Fact, JSONValue, Verdict
from kvfence.audit.checks.latency.analysis import (
    LatencyAnalysis,
    LatencyConfig,
    LatencySample,
    analyse,
    design_p_value,
)
from kvfence.audit.checks.latency.log import analyse_log, latency_command, parse_log_lines
from kvfence.audit.checks.latency.pilot import Pace, planned_probes, time_warm_up
from kvfence.audit.checks.latency.resweep import (
    POWER_FACTOR,
    closer_neighbour,
    hopeless,
    noise_hid_a_skip,
    noise_needs,
    repeats_for_need,
    repeats_that_fit,
)
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
        client = ctx.client(target, "b", paced=True)
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
        lengths = cfg.sweep(limit, facts.pool_tokens.as_int())
        repeats = cfg.sweep_repeats(level)
        pace = time_warm_up(ctx, client, lengths, cfg.pilot, cfg.warmup, ids)
        lengths = closer_neighbour(lengths, list(pace.samples))
        need_s = pace.sweep_s(planned_probes(lengths, repeats))
        if need_s is not None and need_s > ctx.budget.remaining_s:
            return self._unaffordable(target, lengths, repeats, pace, need_s, ctx, limit_fact)
        sweep, result, earlier = _decisive_sweep(ctx, client, cfg, lengths, repeats)
        evidence = result.evidence
        evidence["warm_up"] = pace.to_json()
        evidence["token_ids"] = {"range": list(ids), "vocab_size": facts.vocab_size.to_json()}
        evidence["alpha_per_sweep"] = level
        out = self._report(target, cfg, sweep, result, earlier)
        evidence["sweep"]["limit"] = limit_fact.to_json()
        out.alpha = alpha
        return out

    def _report(
        self,
        target: Target,
        cfg: LatencyConfig,
        sweep: Sweep,
        result: LatencyAnalysis,
        earlier: list[dict[str, JSONValue]],
    ) -> CheckResult:
        """The deciding sweep's result, with its shape, the sweeps it replaced and its
        failed probes on record."""
        evidence = result.evidence
        repeats, lengths = sweep.repeats, sorted(sweep.planned)
        evidence["sweep"] = sweep.to_json(lengths, repeats)
        evidence["earlier_sweeps"] = earlier  # ambiguous ones, each replaced by a fresh sweep
        evidence["design_p_value"] = 2 * design_p_value(repeats, repeats, cfg.slack)
        evidence.update(sweep.failures_json())
        verdict, summary = result.verdict, result.summary
        if earlier:
            first, p = earlier[0], earlier[0]["p_value"]
            shown = f"p = {p:.2g}" if isinstance(p, float) else "no p-value"
            summary = f"sweep {len(earlier) + 1} (sweep 1: {first['verdict']}, {shown}): {summary}"
        verdict, summary = _failed_probes(verdict, summary, sweep, cfg)
        plots = [result.plot] if result.plot is not None else []
        out = self.result(target, verdict, summary, evidence, plots)
        # Bonferroni-adjusted over the sweeps the design allows: comparable with the check's alpha.
        p = result.p_value
        out.p_value = None if p is None else min(1.0, p * cfg.sweeps)
        return out

    def _unaffordable(
        self,
        target: Target,
        lengths: list[int],
        repeats: int,
        pace: Pace,
        need_s: float,
        ctx: AuditContext,
        limit: Fact,
    ) -> CheckResult:
        """Inconclusive before the sweep: at the pace the warm-up measured it would outlast
        the audit's time, and a sweep cut short decides nothing."""
        planned = planned_probes(lengths, repeats)
        left = ctx.budget.remaining_s
        shown = ", ".join(f"{n} tokens {s:.2f} s" for n, s in pace.median_s().items())
        return self.result(
            target,
            Verdict.INCONCLUSIVE,
            f"no time for a sweep: {sum(planned.values())} probes ({repeats} per compared "
            f"length) need about {need_s:.0f} s at the pace the warm-up measured ({shown}), "
            f"and the audit has {left:.0f} s left (raise --max-seconds)",
            {
                "sweep": {
                    "lengths": list(lengths),
                    "repeats": repeats,
                    "repeats_per_length": {str(n): k for n, k in planned.items()},
                    "limit": limit.to_json(),
                },
                "warm_up": pace.to_json(),
                "needed_s": round(need_s, 1),
                "budget_left_s": round(left, 1),
            },
        )


def _failed_probes(
    verdict: Verdict, summary: str, sweep: Sweep, cfg: LatencyConfig
) -> tuple[Verdict, str]:
    """Too many failed probes leave no verdict but a FAIL standing; the summary then says how
    many failed and what the engine said to the first."""
    planned = sum(sweep.planned.values()) or len(sweep.samples) + len(sweep.errors)
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
        started = time.monotonic()
        sweep = _sweep(ctx, client, cfg, lengths, repeats)
        took = time.monotonic() - started
        result = analyse(sweep.samples, cfg)
        if len(earlier) + 1 >= cfg.sweeps or not _ambiguous(result, cfg):
            return sweep, result, earlier
        entry: dict[str, JSONValue] = {
            "verdict": result.verdict.value,
            "p_value": result.p_value,
            "summary": result.summary,
            "repeats": repeats,
            "seconds": round(took, 1),
        }
        if noise_hid_a_skip(result, cfg):
            resized = _resized(ctx, sweep, result, took, cfg, lengths, repeats, entry)
            if isinstance(resized, NoSweepDecides):
                result.summary += "; " + resized.say(took / max(1, sweep.probes), lengths)
                result.evidence["next_sweep"] = resized.to_json()
                return sweep, result, earlier
            lengths, repeats = resized
        next_s = took * sum(planned_probes(lengths, repeats).values()) / max(1, sweep.probes)
        if next_s > ctx.budget.remaining_s:
            # A fresh sweep cut short by the budget would decide nothing and hide this one.
            left = ctx.budget.remaining_s
            result.summary += (
                f"; no time for a fresh sweep (about {next_s:.0f} s at this one's pace, "
                f"{left:.0f} s left in the audit's budget)"
            )
            result.evidence["next_sweep"] = {"needed_s": round(next_s, 1), "left_s": round(left)}
            return sweep, result, earlier
        earlier.append(entry)


def _resized(
    ctx: AuditContext,
    sweep: Sweep,
    result: LatencyAnalysis,
    took: float,
    cfg: LatencyConfig,
    lengths: list[int],
    repeats: int,
    entry: dict[str, JSONValue],
) -> tuple[list[int], int] | NoSweepDecides:
    """The next sweep's lengths and repeats after one whose noise could hide a skip: the
    neighbour moved closer where the cost jumps past it, else the repeats the noise needs,
    within what the budget fits (both recorded in `entry`). `NoSweepDecides`: the noise
    needs far more repeats for a pass, and for a fail, than the check's cap or the budget
    allow (`resweep.hopeless`; where the neighbour would move, a pass judged by the long
    prompts' own separation alone), so a fresh sweep would end undecided too."""
    probes = len(sweep.samples) + len(sweep.errors)
    fits = repeats_that_fit(ctx.budget.remaining_s, took, probes, lengths)
    closer = closer_neighbour(lengths, sweep.samples)
    moved = closer != lengths
    need = noise_needs(sweep.samples, cfg, repeats, result.p_value, paid_only=moved)
    if hopeless(need, min(cfg.max_repeats, fits)):
        return NoSweepDecides(None if math.isinf(need) else math.ceil(need), cfg.max_repeats, fits)
    if moved:
        # A new neighbour's separation is unknown: the power factor's margin on top.
        wanted = math.ceil(POWER_FACTOR * repeats)
        entry["neighbour_moved"] = {"from": lengths[-2], "to": closer[-2]}
        lengths = closer
    else:
        wanted = repeats_for_need(need, cfg, repeats)
    entry["next_repeats"] = {"wanted": wanted, "fit_the_budget": fits}
    return lengths, max(repeats, min(wanted, fits))


@dataclass(frozen=True, slots=True)
class NoSweepDecides:
    """What a fresh sweep would need where none the check may run could decide: repeats per
    compared length (None: unbounded), the check's cap, and what the budget left fits."""

    needed: int | None
    most: int
    fits: int

    def say(self, per_probe_s: float, lengths: list[int]) -> str:
        if self.needed is None:
            need = "more probes than any sweep: the prompts it compares did not separate at all"
        else:
            seconds = sum(planned_probes(lengths, self.needed).values()) * per_probe_s
            need = (
                f"about {self.needed} probes per compared length (about {seconds:.0f} s at "
                f"this sweep's pace)"
            )
        return (
            f"a fresh sweep would not decide either: this target's noise needs {need}, and "
            f"the check runs at most {self.most} (the audit's time left fits {self.fits})"
        )

    def to_json(self) -> dict[str, JSONValue]:
        return {"needed": self.needed, "most": self.most, "fit_the_budget": self.fits}


def _ambiguous(result: LatencyAnalysis, cfg: LatencyConfig) -> bool:
    """Worth a fresh sweep: undecided, or a pass whose p-value leans towards a skip."""
    if result.verdict is Verdict.INCONCLUSIVE:
        return True
    p = result.p_value
    return result.verdict is Verdict.PASS and p is not None and p < cfg.recheck_below


@dataclass(slots=True)
class Sweep:
    repeats: int = 0  # per length the test compares (short, neighbour, long)
    planned: dict[int, int] = field(default_factory=dict)  # prompt length -> probes planned
    samples: list[LatencySample] = field(default_factory=list)
    errors: list[dict[str, JSONValue]] = field(default_factory=list)
    mismatched: list[dict[str, JSONValue]] = field(default_factory=list)

    @property
    def probes(self) -> int:
        return sum(self.planned.values())

    def to_json(self, lengths: list[int], repeats: int) -> dict[str, JSONValue]:
        per_length = {str(n): k for n, k in sorted(self.planned.items())}
        return {"lengths": list(lengths), "repeats": repeats, "repeats_per_length": per_length}

    def failures_json(self) -> dict[str, JSONValue]:
        return {
            "errors": self.errors[:5],
            "error_count": len(self.errors),
            "usage_mismatches": self.mismatched,
        }


def _sweep(
    ctx: AuditContext, client: ProbeClient, cfg: LatencyConfig, lengths: list[int], repeats: int
) -> Sweep:
    """Time fresh prompts, `planned_probes` of each length, interleaved (drift hits all
    lengths)."""
    rng = random.Random(ctx.rng.random())
    lo, hi = cfg.token_range
    planned = planned_probes(lengths, repeats)
    plan = [n for n in lengths for _ in range(planned[n])]
    # Interleaved: drift cannot masquerade as a slope, and load hits long and reference
    # probes alike (the exchangeability the test's H0 rests on).
    rng.shuffle(plan)
    out = Sweep(repeats=repeats, planned=planned)
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
