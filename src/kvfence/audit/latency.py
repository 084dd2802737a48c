"""Prefill latency: "latency that is too good" (INCIDENT.md, runbook signal 3).

A full prefill costs time roughly linear in the prompt length. A long prompt
answered in the time a short one takes was not prefilled: the engine reused
someone's KV (a cross-tenant cache hit) or replaced the prompt with a
placeholder (the Workers AI reject path). The check

1. times fresh random prompts (TTFT of a streaming ``max_tokens=1``
   completion) over a sweep of lengths up to the longest accepted prompt,
   several repeats each; every prompt is new random token ids, so no probe
   can legitimately hit any cache;
2. fits prefill cost vs length (Theil–Sen) on every bucket except the
   longest, and measures the noise as the robust spread of the short
   bucket's residuals;
3. fails when the long bucket's p5 lies below the fit's prediction by more
   than the tolerance: ``max(k·σ_short, f·(pred_long − pred_short))`` — at
   least k noise widths *and* a fraction f of the predicted extra prefill
   cost skipped;
4. is inconclusive when the predicted prefill cost of the long bucket over
   the short one is not above the noise (the physics is not measurable, so
   "too fast" cannot be told from "fast"), or when too few probes answered.

`analyse_log` runs steps 2–4 on a request log instead of live probes.

Accepted log formats (JSON lines; blank lines and non-JSON lines are skipped
and counted). Per-request objects — the fields are looked up at the top
level and inside ``meta_info``, ``out.meta_info``, ``usage``, ``metrics``,
``timings`` and ``stats``:

- prompt length: ``prompt_tokens`` (OpenAI usage, SGLang ``meta_info``),
  ``num_prompt_tokens`` (vLLM ``FinishedRequestStats``), ``prompt_len``,
  ``input_len``, ``input_tokens``, ``n_prompt_tokens``, ``prompt_n`` +
  ``cache_n`` (llama.cpp ``timings``; the prompt is both together);
- prefill time, preferred when present (engine-side, no network or
  queueing): ``prefill_time`` (vLLM ``FinishedRequestStats``, seconds),
  ``prefill_latency``, ``request_prefill_time_seconds``, ``prefill_s``;
  milliseconds: ``prefill_ms``, ``prompt_ms`` (llama.cpp ``timings``);
- time to first token, seconds: ``ttft``, ``ttft_s``,
  ``time_to_first_token``, ``time_to_first_token_seconds``,
  ``first_token_latency`` (vLLM ``RequestStateStats``); milliseconds:
  ``ttft_ms``, ``time_to_first_token_ms``;
- end-to-end latency (``e2e_latency`` in SGLang's ``--log-requests
  --log-requests-format json`` ``request.finished`` lines, seconds;
  ``e2e_latency_ms``): used only for requests that generated at most one
  token (``completion_tokens`` <= 1), where it is a prefill time.

Benchmark result objects (vLLM ``bench serve --save-result`` and SGLang
``bench_serving --output-details`` JSON lines): the parallel arrays
``input_lens`` and ``ttfts`` (seconds), skipping entries whose ``errors``
item is non-empty or whose TTFT is not positive.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import click
import numpy as np

from kvfence.audit.base import (
    AuditContext,
    Check,
    CheckResult,
    JSONValue,
    Plot,
    PlotSeries,
    Verdict,
)
from kvfence.audit.stats import LinearFit, percentile, robust_line, robust_sigma
from kvfence.audit.targets.base import Target

TimingKind = Literal["prefill", "ttft", "e2e"]

# Field names, in order of preference (see the module docstring).
PROMPT_FIELDS = (
    "prompt_tokens",
    "num_prompt_tokens",
    "prompt_len",
    "input_len",
    "input_tokens",
    "n_prompt_tokens",
)
PREFILL_S_FIELDS = ("prefill_time", "prefill_latency", "request_prefill_time_seconds", "prefill_s")
PREFILL_MS_FIELDS = ("prefill_ms", "prompt_ms")
TTFT_S_FIELDS = (
    "ttft",
    "ttft_s",
    "time_to_first_token",
    "time_to_first_token_seconds",
    "first_token_latency",
)
TTFT_MS_FIELDS = ("ttft_ms", "time_to_first_token_ms")
E2E_S_FIELDS = ("e2e_latency",)
E2E_MS_FIELDS = ("e2e_latency_ms",)
NESTED = ("meta_info", "usage", "metrics", "timings", "stats")


@dataclass(frozen=True, slots=True)
class LatencySample:
    """One timed request: prompt length in tokens and seconds until prefill ended."""

    prompt_tokens: int
    seconds: float
    kind: TimingKind = "ttft"
    source: str = ""  # "line 12", "probe 7": where a flagged point came from


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    """Thresholds of the analysis and the live sweep's shape.

    ``tolerance_sigmas`` (k) and ``skipped_fraction`` (f) define the alarm:
    the long bucket's p5 must sit more than ``max(k·σ, f·increment)`` below
    the prediction. ``lengths`` overrides the sweep (else geometric from
    ``min_tokens`` to the longest accepted prompt, ``points`` lengths).
    """

    tolerance_sigmas: float = 4.0
    skipped_fraction: float = 0.5
    long_quantile: float = 5.0
    repeats: int = 4
    points: int = 5
    min_tokens: int = 16
    max_tokens_cap: int | None = None
    lengths: tuple[int, ...] | None = None
    min_samples: int = 8
    noise_floor_s: float = 1e-4
    warmup: int = 1
    max_error_fraction: float = 0.2
    token_range: tuple[int, int] = (100, 500)

    def __post_init__(self) -> None:
        if self.tolerance_sigmas <= 0 or not 0 < self.skipped_fraction <= 1:
            raise ValueError("need tolerance_sigmas > 0 and 0 < skipped_fraction <= 1")
        if not 0 < self.long_quantile < 50:
            raise ValueError("long_quantile must be in (0, 50)")
        if self.repeats < 1 or self.points < 3 or self.min_tokens < 1:
            raise ValueError("need repeats >= 1, points >= 3, min_tokens >= 1")

    def sweep(self, longest_accepted: int) -> list[int]:
        """The prompt lengths to probe, ending at the longest accepted prompt."""
        if self.lengths is not None:
            return sorted(set(self.lengths))
        top = longest_accepted
        if self.max_tokens_cap is not None:
            top = min(top, self.max_tokens_cap)
        if top <= self.min_tokens:
            return [top]
        grid = np.geomspace(self.min_tokens, top, self.points)
        return sorted({round(float(v)) for v in grid} | {top})


@dataclass(slots=True)
class LatencyAnalysis:
    """The outcome of the analysis: verdict, summary, evidence and plot data."""

    verdict: Verdict
    summary: str
    evidence: dict[str, JSONValue] = field(default_factory=dict)
    plot: Plot | None = None
    fit: LinearFit | None = None
    flagged: list[LatencySample] = field(default_factory=list)


def _buckets(samples: Sequence[LatencySample]) -> tuple[list[LatencySample], list[LatencySample]]:
    """Split into (short, long) buckets.

    A sweep (few distinct lengths) buckets by exact length: short = the
    shortest length, long = the longest. A log (many lengths) uses quantiles:
    long = the top decile of lengths, short = the bottom fifth.
    """
    lengths = sorted({s.prompt_tokens for s in samples})
    if len(lengths) <= 12:
        short = [s for s in samples if s.prompt_tokens == lengths[0]]
        long = [s for s in samples if s.prompt_tokens == lengths[-1]]
        return short, long
    arr = np.array([s.prompt_tokens for s in samples], dtype=float)
    lo, hi = np.percentile(arr, 20), np.percentile(arr, 90)
    short = [s for s in samples if s.prompt_tokens <= lo]
    long = [s for s in samples if s.prompt_tokens >= hi]
    return short, long


def analyse(
    samples: Sequence[LatencySample], config: LatencyConfig | None = None
) -> LatencyAnalysis:
    """Fit prefill cost on all but the long bucket; judge the long bucket's p5 against it."""
    cfg = config or LatencyConfig()
    if len(samples) < cfg.min_samples:
        return LatencyAnalysis(
            Verdict.INCONCLUSIVE,
            f"only {len(samples)} timed requests (need {cfg.min_samples})",
            {"samples": len(samples)},
        )
    short, long = _buckets(samples)
    long_ids = {id(s) for s in long}
    reference = [s for s in samples if id(s) not in long_ids]
    ref_lengths = {s.prompt_tokens for s in reference}
    if len(ref_lengths) < 2 or len(reference) < 3 or len(long) < 1:
        return LatencyAnalysis(
            Verdict.INCONCLUSIVE,
            "need at least two shorter prompt lengths and a long bucket to fit prefill cost",
            {"samples": len(samples), "distinct_lengths": len(ref_lengths) + 1},
        )
    fit = robust_line([s.prompt_tokens for s in reference], [s.seconds for s in reference])
    short_resid = [s.seconds - float(fit.predict(s.prompt_tokens)) for s in short]
    sigma = max(robust_sigma(short_resid), cfg.noise_floor_s)
    long_len = float(np.median([s.prompt_tokens for s in long]))
    short_len = float(np.median([s.prompt_tokens for s in short]))
    pred_long = float(fit.predict(long_len))
    pred_short = float(fit.predict(short_len))
    increment = pred_long - pred_short
    tolerance = max(cfg.tolerance_sigmas * sigma, cfg.skipped_fraction * increment)
    p5_long = percentile([s.seconds for s in long], cfg.long_quantile)
    threshold = pred_long - tolerance
    flagged = [
        s
        for s in samples
        if s.prompt_tokens > short_len
        and s.seconds < float(fit.predict(s.prompt_tokens)) - tolerance
    ]
    kinds = Counter(s.kind for s in samples)
    evidence: dict[str, JSONValue] = {
        "samples": len(samples),
        "timing": dict(kinds),
        "fit": {
            "slope_s_per_token": fit.slope,
            "intercept_s": fit.intercept,
            "slope_95ci": [fit.slope_low, fit.slope_high],
            "residual_sigma_s": fit.residual_sigma,
            "fitted_on": len(reference),
        },
        "short_bucket": {"tokens": short_len, "n": len(short), "noise_sigma_s": sigma},
        "long_bucket": {
            "tokens": long_len,
            "n": len(long),
            f"p{cfg.long_quantile:g}_s": p5_long,
            "median_s": float(np.median([s.seconds for s in long])),
            "predicted_s": pred_long,
        },
        "predicted_prefill_increment_s": increment,
        "tolerance_s": tolerance,
        "alarm_threshold_s": threshold,
        "flagged": [
            {"prompt_tokens": s.prompt_tokens, "seconds": s.seconds, "source": s.source}
            for s in flagged[:50]
        ],
        "flagged_count": len(flagged),
    }
    plot = _plot(samples, fit, flagged)
    measurable = fit.slope > 0 and increment >= cfg.tolerance_sigmas * sigma
    if p5_long < threshold and measurable:
        verdict = Verdict.FAIL
        summary = (
            f"long prompts ({long_len:.0f} tokens) answered too fast: p{cfg.long_quantile:g} "
            f"{p5_long * 1e3:.2f} ms < {threshold * 1e3:.2f} ms allowed by the prefill fit "
            f"(predicted {pred_long * 1e3:.2f} ms); {len(flagged)} request(s) flagged"
        )
    elif not measurable:
        verdict = Verdict.INCONCLUSIVE
        summary = (
            f"prefill cost not measurable above noise: {long_len:.0f}-token prompts are predicted "
            f"only {increment * 1e3:.3f} ms slower than {short_len:.0f}-token ones "
            f"(noise σ {sigma * 1e3:.3f} ms, need {cfg.tolerance_sigmas:g}σ)"
        )
    else:
        verdict = Verdict.PASS
        summary = (
            f"long prompts pay their prefill: p{cfg.long_quantile:g} {p5_long * 1e3:.2f} ms >= "
            f"{threshold * 1e3:.2f} ms (fit {fit.slope * 1e6:.2f} µs/token, "
            f"noise σ {sigma * 1e3:.3f} ms)"
        )
    return LatencyAnalysis(verdict, summary, evidence, plot, fit, flagged)


def _plot(samples: Sequence[LatencySample], fit: LinearFit, flagged: list[LatencySample]) -> Plot:
    flagged_ids = {id(s) for s in flagged}
    xs = [float(s.prompt_tokens) for s in samples]
    lo, hi = min(xs), max(xs)
    return Plot(
        kind="xy",
        title="TTFT vs prompt length",
        x_label="prompt tokens",
        y_label="seconds",
        series=[
            PlotSeries(
                "requests",
                x=xs,
                y=[s.seconds for s in samples],
                style="points",
                flags=[id(s) in flagged_ids for s in samples],
                labels=[s.source for s in samples],
            ),
            PlotSeries(
                "prefill fit",
                x=[lo, hi],
                y=[float(fit.predict(lo)), float(fit.predict(hi))],
                style="line",
            ),
        ],
        note="fit on all but the longest bucket (Theil–Sen); red points are faster than the fit allows",
    )


# -- live probes ----------------------------------------------------------------


class LatencyCheck(Check):
    """Live sweep: TTFT of fresh random prompts up to the longest accepted prompt."""

    name = "latency"
    description = (
        "no long prompt completes prefill faster than the engine's own prefill cost allows "
        "(TTFT vs length fit; alarm on the long bucket's p5)"
    )

    def __init__(self, config: LatencyConfig | None = None) -> None:
        self.config = config or LatencyConfig()

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        cfg = self.config
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
        lengths = cfg.sweep(limit)
        rng = random.Random(ctx.rng.random())
        lo, hi = cfg.token_range
        plan = [n for n in lengths for _ in range(cfg.repeats)]
        rng.shuffle(plan)  # interleave lengths so drift cannot masquerade as a slope
        for _ in range(cfg.warmup):  # the first request pays one-off start-up costs
            client.ttft([rng.randrange(lo, hi) for _ in range(min(lengths))])
        samples: list[LatencySample] = []
        errors: list[dict[str, JSONValue]] = []
        mismatched: list[dict[str, JSONValue]] = []
        for i, n in enumerate(plan):
            r = client.ttft([rng.randrange(lo, hi) for _ in range(n)])
            if r.ok and r.ttft_s is not None:
                samples.append(LatencySample(n, r.ttft_s, "ttft", f"probe {i}: {n} tokens"))
                if r.prompt_tokens is not None and r.prompt_tokens != n and len(mismatched) < 5:
                    mismatched.append({"sent": n, "usage_prompt_tokens": r.prompt_tokens})
            else:
                errors.append({"prompt_tokens": n, **r.brief()})
            ctx.progress("prefill latency sweep", (i + 1) / len(plan))
        result = analyse(samples, cfg)
        evidence = result.evidence
        evidence["sweep"] = {
            "lengths": lengths,
            "repeats": cfg.repeats,
            "limit": limit_fact.to_json(),
        }
        evidence["errors"] = errors[:5]
        evidence["error_count"] = len(errors)
        evidence["usage_mismatches"] = mismatched
        verdict, summary = result.verdict, result.summary
        if verdict is not Verdict.FAIL and len(errors) > cfg.max_error_fraction * len(plan):
            verdict = Verdict.INCONCLUSIVE
            summary = f"{len(errors)} of {len(plan)} timing probes failed; {summary}"
        plots = [result.plot] if result.plot is not None else []
        return self.result(target, verdict, summary, evidence, plots)


# -- request logs -------------------------------------------------------------


@dataclass(slots=True)
class LogParse:
    """Samples read from a log and why other lines were skipped."""

    samples: list[LatencySample] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    lines: int = 0


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _scopes(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The object and its nested metric holders, outermost first."""
    yield obj
    for key in NESTED:
        inner = obj.get(key)
        if isinstance(inner, dict):
            yield inner
    out = obj.get("out")
    if isinstance(out, dict):
        yield from _scopes(out)


def _first(scopes: list[dict[str, Any]], names: Iterable[str]) -> float | None:
    for name in names:
        for scope in scopes:
            v = _number(scope.get(name))
            if v is not None:
                return v
    return None


def _prompt_tokens(scopes: list[dict[str, Any]]) -> int | None:
    n = _first(scopes, PROMPT_FIELDS)
    if n is None:
        # llama.cpp `timings`: prompt_n tokens evaluated plus cache_n reused.
        evaluated = _first(scopes, ("prompt_n",))
        if evaluated is not None:
            n = evaluated + (_first(scopes, ("cache_n",)) or 0.0)
    return int(n) if n is not None and n > 0 else None


def _timing(scopes: list[dict[str, Any]]) -> tuple[float, TimingKind] | None:
    preferred: tuple[tuple[tuple[str, ...], float, TimingKind], ...] = (
        (PREFILL_S_FIELDS, 1.0, "prefill"),
        (PREFILL_MS_FIELDS, 1e-3, "prefill"),
        (TTFT_S_FIELDS, 1.0, "ttft"),
        (TTFT_MS_FIELDS, 1e-3, "ttft"),
    )
    for names, scale, kind in preferred:
        v = _first(scopes, names)
        if v is not None and v > 0:
            return v * scale, kind
    completion = _first(scopes, ("completion_tokens", "num_generation_tokens"))
    if completion is not None and completion <= 1:
        for e2e_names, scale in ((E2E_S_FIELDS, 1.0), (E2E_MS_FIELDS, 1e-3)):
            v = _first(scopes, e2e_names)
            if v is not None and v > 0:
                return v * scale, "e2e"
    return None


def _from_bench(obj: dict[str, Any], lineno: int, parse: LogParse) -> None:
    lens, ttfts = obj.get("input_lens"), obj.get("ttfts")
    assert isinstance(lens, list) and isinstance(ttfts, list)
    errors = obj.get("errors")
    errs = errors if isinstance(errors, list) else [None] * len(lens)
    for i, (n, t) in enumerate(zip(lens, ttfts, strict=False)):
        err = errs[i] if i < len(errs) else None
        nv, tv = _number(n), _number(t)
        if err:
            parse.skipped["bench entry with an error"] += 1
        elif nv is None or tv is None or nv <= 0 or tv <= 0:
            parse.skipped["bench entry without length or TTFT"] += 1
        else:
            parse.samples.append(LatencySample(int(nv), tv, "ttft", f"line {lineno} [{i}]"))


def parse_log_lines(lines: Iterable[str]) -> LogParse:
    """Read samples from JSON lines (formats in the module docstring)."""
    parse = LogParse()
    for lineno, raw in enumerate(lines, start=1):
        parse.lines += 1
        line = raw.strip()
        if not line:
            continue
        # Logs often prefix JSON with a timestamp / level: start at the first brace.
        brace = line.find("{")
        if brace < 0:
            parse.skipped["not JSON"] += 1
            continue
        try:
            obj = json.loads(line[brace:])
        except ValueError:
            parse.skipped["not JSON"] += 1
            continue
        if not isinstance(obj, dict):
            parse.skipped["not a JSON object"] += 1
            continue
        if isinstance(obj.get("input_lens"), list) and isinstance(obj.get("ttfts"), list):
            _from_bench(obj, lineno, parse)
            continue
        scopes = list(_scopes(obj))
        n = _prompt_tokens(scopes)
        timing = _timing(scopes)
        if n is None:
            parse.skipped["no prompt-token field"] += 1
        elif timing is None:
            parse.skipped["no TTFT / prefill-time field"] += 1
        else:
            parse.samples.append(LatencySample(n, timing[0], timing[1], f"line {lineno}"))
    return parse


def analyse_log(path: str | Path, config: LatencyConfig | None = None) -> LatencyAnalysis:
    """Run the prefill-latency analysis on a request log without sending any traffic.

    When the log mixes timing kinds, the most precise kind with enough samples
    is used (engine prefill time > TTFT > single-token end-to-end latency):
    mixing them would fit one line through two different clocks.
    """
    cfg = config or LatencyConfig()
    with open(path, encoding="utf-8", errors="replace") as fh:
        parse = parse_log_lines(fh)
    by_kind: dict[str, list[LatencySample]] = {}
    for s in parse.samples:
        by_kind.setdefault(s.kind, []).append(s)
    chosen: list[LatencySample] = []
    for kind in ("prefill", "ttft", "e2e"):
        if len(by_kind.get(kind, [])) >= cfg.min_samples:
            chosen = by_kind[kind]
            break
    else:
        chosen = parse.samples
    result = analyse(chosen, cfg)
    result.evidence["log"] = {
        "path": str(path),
        "lines": parse.lines,
        "samples_read": len(parse.samples),
        "samples_used": len(chosen),
        "skipped": dict(parse.skipped),
    }
    return result


_DEFAULTS = LatencyConfig()  # frozen: CLI defaults are read from the config dataclass


@click.command("latency")
@click.option(
    "--from-log",
    "log_path",
    type=click.Path(exists=True, dir_okay=False),
    required=True,
    help="JSON-lines request log (vLLM / SGLang / llama.cpp / bench results); no traffic is sent",
)
@click.option(
    "--tolerance-sigmas", type=float, default=_DEFAULTS.tolerance_sigmas, show_default=True
)
@click.option(
    "--skipped-fraction", type=float, default=_DEFAULTS.skipped_fraction, show_default=True
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def latency_command(
    log_path: str, tolerance_sigmas: float, skipped_fraction: float, json_out: str | None
) -> None:
    """Prefill-latency check on a request log: exit 0 pass, 1 fail, 2 inconclusive."""
    try:
        cfg = LatencyConfig(tolerance_sigmas=tolerance_sigmas, skipped_fraction=skipped_fraction)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    result = analyse_log(log_path, cfg)
    click.echo(f"prefill latency: {result.verdict.value}: {result.summary}")
    log = result.evidence.get("log", {})
    click.echo(
        f"  {log.get('samples_used')} of {log.get('samples_read')} timed requests used "
        f"({log.get('lines')} lines; skipped: {log.get('skipped') or 'none'})"
    )
    if json_out:
        payload: dict[str, JSONValue] = {
            "verdict": result.verdict.value,
            "summary": result.summary,
            "evidence": result.evidence,
            "plot": result.plot.to_json() if result.plot else None,
        }
        Path(json_out).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    sys.exit({Verdict.PASS: 0, Verdict.FAIL: 1}.get(result.verdict, 2))
