"""Request logs for the prefill-latency analysis: `kvfence audit latency --from-log FILE`.

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
item is non-empty or whose TTFT is not positive. vLLM writes those arrays only
with ``--save-detailed`` (SGLang only with ``--output-details``); a result
without them (run-level ``mean_ttft_ms`` and such) holds no request to time,
and the analysis says which flag the benchmark needs.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from kvfence.audit.base import DEFAULT_ALPHA, JSONValue, Verdict
from kvfence.audit.checks.latency.analysis import (
    LatencyAnalysis,
    LatencyConfig,
    LatencySample,
    TimingKind,
    analyse,
)

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
# A benchmark's run-level summary (averages only): its per-request arrays were left out.
BENCH_SUMMARY_FIELDS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms")
BENCH_SUMMARY = "benchmark summary without per-request timings"
BENCH_ADVICE = (
    "the log is a benchmark's run-level summary, with no per-request timings: rerun "
    "`vllm bench serve --save-result` with --save-detailed (SGLang's bench_serving: "
    "--output-details) so the result keeps input_lens and ttfts"
)


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
        if any(k in obj for k in BENCH_SUMMARY_FIELDS):
            parse.skipped[BENCH_SUMMARY] += 1
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
    if not parse.samples and parse.skipped[BENCH_SUMMARY]:
        result.summary = f"{BENCH_ADVICE}; {result.summary}"
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
    "--skipped-fraction", type=float, default=_DEFAULTS.skipped_fraction, show_default=True
)
@click.option(
    "--alpha",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=DEFAULT_ALPHA,
    show_default=True,
    help="level of the exact test (H0: the long prompts were prefilled)",
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def latency_command(
    log_path: str,
    skipped_fraction: float,
    alpha: float,
    json_out: str | None,
) -> None:
    """Prefill-latency check on a request log: exit 0 pass, 1 fail, 2 inconclusive."""
    try:
        cfg = LatencyConfig(skipped_fraction=skipped_fraction, alpha=alpha)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    result = analyse_log(log_path, cfg)
    click.echo(f"prefill latency: {result.verdict.value}: {result.summary}")
    log = result.evidence.get("log", {})
    skipped = log.get("skipped") if isinstance(log, dict) else None
    why = ", ".join(f"{n} {k}" for k, n in skipped.items()) if isinstance(skipped, dict) else ""
    click.echo(
        f"  {log.get('samples_used')} of {log.get('samples_read')} timed requests used "
        f"({log.get('lines')} lines; skipped: {why or 'none'})"
    )
    if json_out:
        payload: dict[str, JSONValue] = {
            "verdict": result.verdict.value,
            "summary": result.summary,
            "p_value": result.p_value,
            "alpha": result.alpha,
            "evidence": result.evidence,
            "plot": result.plot.to_json() if result.plot else None,
        }
        Path(json_out).write_text(json.dumps(payload, indent=2), encoding="utf-8")
    sys.exit({Verdict.PASS: 0, Verdict.FAIL: 1}.get(result.verdict, 2))
