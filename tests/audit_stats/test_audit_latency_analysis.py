"""Prefill-latency analysis on synthetic sweeps and on vLLM / SGLang / llama.cpp-shaped logs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvfence.audit.base import Verdict
from kvfence.audit.checks.latency.check import (
    LatencyConfig,
    LatencySample,
    analyse,
    analyse_log,
    latency_command,
    parse_log_lines,
)

LENGTHS = (16, 64, 256, 1024, 2048, 4096)
# Probes per length: at alpha 1e-3 the exact test needs 19 long and 19 neighbour probes
# (LatencyConfig().repeats_for(1e-3): a total skip reaches it with 4 probes to spare).
REPEATS = 19


def _sweep(
    seed: int, *, placeholder_long: bool = False, slope: float = 5e-6, repeats: int = REPEATS
) -> list[LatencySample]:
    """TTFT = 4 ms + slope·tokens + noise; optionally the long bucket skips its prefill."""
    rng = np.random.default_rng(seed)
    out = []
    for n in LENGTHS:
        for r in range(repeats):
            cost = 0.004 + slope * n + rng.normal(0, 2e-4)
            if placeholder_long and n == LENGTHS[-1]:
                cost = 0.004 + slope * 1 + rng.normal(0, 2e-4)  # the 1-token placeholder
            out.append(LatencySample(n, cost, "ttft", f"probe {n}/{r}"))
    return out


def test_honest_engine_passes() -> None:
    res = analyse(_sweep(1))
    assert res.verdict is Verdict.PASS, res.summary
    assert res.flagged == []
    assert res.fit is not None and res.fit.slope == pytest.approx(5e-6, rel=0.2)


def test_long_prompts_answered_at_short_prompt_speed_fail_with_flagged_points() -> None:
    res = analyse(_sweep(2, placeholder_long=True))
    assert res.verdict is Verdict.FAIL, res.summary
    assert {s.prompt_tokens for s in res.flagged} == {4096}
    assert len(res.flagged) == REPEATS
    assert res.p_value is not None and res.p_value < res.alpha == 1e-3
    test = res.evidence["test"]
    assert test[test["decided_by"]]["long_fast"] == REPEATS
    assert res.plot is not None
    points = res.plot.series[0]
    assert sum(points.flags) == REPEATS
    assert res.plot.series[1].style == "line"
    json.dumps(res.evidence)  # evidence is JSON-serialisable


def test_too_few_probes_for_alpha_is_inconclusive_and_says_how_many_would_do() -> None:
    res = analyse(_sweep(2, placeholder_long=True, repeats=5))  # best p = 1/C(10,5) = 4e-3
    assert res.verdict is Verdict.INCONCLUSIVE, res.summary
    assert "19 long and 19 neighbour probes would" in res.summary
    assert LatencyConfig().repeats_for(1e-3) == REPEATS


def test_alpha_decides_and_the_verdict_carries_it() -> None:
    leak = _sweep(5, placeholder_long=True)  # p = 2/C(38,19) = 5.7e-11
    assert analyse(leak, LatencyConfig(alpha=1e-3)).verdict is Verdict.FAIL
    strict = analyse(leak, LatencyConfig(alpha=1e-12))
    assert strict.verdict is Verdict.INCONCLUSIVE and strict.alpha == 1e-12
    assert (
        analyse(_sweep(5, placeholder_long=True, repeats=26), LatencyConfig(alpha=1e-12)).verdict
        is Verdict.FAIL
    )


def test_a_concave_cost_curve_is_not_too_fast() -> None:
    """Prefill cost that saturates (batching under load, a GPU below its compute bound):
    a line through the shorter lengths over-predicts the long ones so far that the old
    rule (long below fit − half the predicted increment) fired; the test compares the
    long prompts with their neighbour only, so it passes."""
    rng = np.random.default_rng(7)
    out = []
    for n in LENGTHS:
        for _ in range(REPEATS):
            cost = 0.004 + 0.03 * (1 - np.exp(-n / 700)) + abs(rng.normal(0, 3e-4))
            out.append(LatencySample(n, float(cost)))
    res = analyse(out)
    assert res.verdict is Verdict.PASS, res.summary
    assert res.fit is not None
    pred_long, pred_short = (float(res.fit.predict(n)) for n in (4096, 16))
    old_floor = pred_long - 0.5 * (pred_long - pred_short)
    longs = [s.seconds for s in out if s.prompt_tokens == 4096]
    assert sum(t < old_floor for t in longs) >= 4  # the old p5 rule would have failed it


def test_unmeasurable_prefill_cost_is_inconclusive_not_pass() -> None:
    # Slope so small the whole sweep costs less than the noise.
    res = analyse(_sweep(3, slope=1e-8))
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "not measurable" in res.summary


def test_too_few_samples_or_lengths_is_inconclusive() -> None:
    assert analyse(_sweep(4)[:5]).verdict is Verdict.INCONCLUSIVE
    same = [LatencySample(100, 0.01 + i * 1e-4) for i in range(20)]
    assert analyse(same).verdict is Verdict.INCONCLUSIVE


def test_sweep_ends_at_the_longest_accepted_prompt() -> None:
    cfg = LatencyConfig(points=5, min_tokens=16)
    lengths = cfg.sweep(4095)
    assert lengths[0] == 16 and lengths[-1] == 4095 and len(lengths) == 5
    assert LatencyConfig(max_tokens_cap=1000).sweep(4095)[-1] == 1000
    assert LatencyConfig(lengths=(5, 3, 5)).sweep(100) == [3, 5]


# -- logs ------------------------------------------------------------------------------


def _vllm_line(n: int, t: float) -> str:
    # vLLM FinishedRequestStats field names, as an operator's request hook would dump them.
    return json.dumps(
        {"request_id": "cmpl-1", "num_prompt_tokens": n, "prefill_time": t, "e2e_latency": t + 0.2}
    )


def _sglang_line(n: int, t: float, completion: int = 1) -> str:
    # SGLang --log-requests --log-requests-format json: a request.finished event.
    return json.dumps(
        {
            "timestamp": "2026-09-01T10:00:00",
            "event": "request.finished",
            "rid": "abc",
            "obj": {"text": "…"},
            "out": {
                "text": "x",
                "meta_info": {
                    "prompt_tokens": n,
                    "completion_tokens": completion,
                    "cached_tokens": 0,
                    "e2e_latency": t,
                },
            },
        }
    )


def test_parse_accepts_vllm_sglang_llamacpp_and_openai_shapes() -> None:
    lines = [
        _vllm_line(1000, 0.05),
        _sglang_line(2000, 0.08),
        _sglang_line(2000, 0.9, completion=64),  # e2e includes decode: not a prefill time
        json.dumps({"usage": {"prompt_tokens": 300}, "ttft_ms": 12.5}),
        json.dumps({"timings": {"prompt_n": 100, "cache_n": 28, "prompt_ms": 7.0}}),
        json.dumps({"time_to_first_token": 0.02, "prompt_len": 64}),
        "INFO 10:00:01 " + json.dumps({"num_prompt_tokens": 512, "first_token_latency": 0.03}),
        "not json at all",
        json.dumps({"prompt_tokens": 10}),
        json.dumps({"ttft": 0.1}),
        "",
    ]
    parse = parse_log_lines(lines)
    got = [(s.prompt_tokens, round(s.seconds, 6), s.kind) for s in parse.samples]
    assert got == [
        (1000, 0.05, "prefill"),
        (2000, 0.08, "e2e"),
        (300, 0.0125, "ttft"),
        (128, 0.007, "prefill"),
        (64, 0.02, "ttft"),
        (512, 0.03, "ttft"),
    ]
    assert parse.skipped == {
        "no TTFT / prefill-time field": 2,
        "not JSON": 1,
        "no prompt-token field": 1,
    }


def test_parse_reads_bench_serving_result_arrays() -> None:
    bench = {
        "completed": 3,
        "input_lens": [128, 256, 512, 1024],
        "ttfts": [0.01, 0.02, 0.0, 0.05],
        "errors": ["", "", "timeout", ""],
    }
    parse = parse_log_lines([json.dumps(bench)])
    assert [(s.prompt_tokens, s.seconds) for s in parse.samples] == [
        (128, 0.01),
        (256, 0.02),
        (1024, 0.05),
    ]
    assert parse.skipped["bench entry with an error"] == 1


def _write_log(path: Path, seed: int, *, leak: bool) -> None:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(300):
        n = int(rng.integers(100, 8000))
        t = 0.01 + 1e-5 * n + rng.normal(0, 5e-4)
        if leak and n > 7400 and rng.random() < 0.5:
            t = 0.01 + rng.normal(0, 5e-4)  # a long prompt served from someone's cache
        lines.append(_vllm_line(n, t))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_analyse_log_passes_an_honest_log_and_fails_a_leaking_one(tmp_path: Path) -> None:
    honest, leaking = tmp_path / "honest.jsonl", tmp_path / "leak.jsonl"
    _write_log(honest, 1, leak=False)
    _write_log(leaking, 1, leak=True)
    ok = analyse_log(honest)
    assert ok.verdict is Verdict.PASS, ok.summary
    bad = analyse_log(leaking)
    assert bad.verdict is Verdict.FAIL, bad.summary
    assert all(s.prompt_tokens > 7400 for s in bad.flagged)
    assert bad.evidence["log"]["samples_used"] == 300


def test_latency_command_exit_codes(tmp_path: Path) -> None:
    honest, leaking, empty = tmp_path / "h.jsonl", tmp_path / "l.jsonl", tmp_path / "e.jsonl"
    _write_log(honest, 2, leak=False)
    _write_log(leaking, 2, leak=True)
    empty.write_text("{}\n", encoding="utf-8")
    runner = CliRunner()
    out_json = tmp_path / "out.json"
    r = runner.invoke(latency_command, ["--from-log", str(honest), "--json", str(out_json)])
    assert r.exit_code == 0, r.output
    assert json.loads(out_json.read_text())["verdict"] == "pass"
    r = runner.invoke(latency_command, ["--from-log", str(leaking)])
    assert r.exit_code == 1, r.output
    assert "too fast" in r.output
    r = runner.invoke(latency_command, ["--from-log", str(empty)])
    assert r.exit_code == 2, r.output


def test_false_alarm_rate_is_at_most_alpha_at_the_edge_of_h0() -> None:
    """The worst case H0 allows: the long prompts cost exactly what their neighbours do
    (a saturated cost curve), under heavy-tailed load noise. At alpha 0.05 the test may
    fail at most 5% of honest sweeps (binomial margin for 400 runs: < 9%)."""
    rng = np.random.default_rng(11)
    cfg = LatencyConfig(alpha=0.05)
    fails = 0
    for _ in range(400):
        out = []
        for n in (16, 64, 256, 1024, 1025):  # 1024 and 1025 tokens: the same cost
            for _ in range(8):
                cost = 0.004 + 1e-5 * min(n, 1024) + float(rng.exponential(2e-3))
                out.append(LatencySample(n, cost))
        fails += analyse(out, cfg).verdict is Verdict.FAIL
    assert fails <= 36, fails
    print(f"\nfalse alarms at alpha 0.05: {fails}/400")
