"""The framework fails closed, reports are well-formed, and the pure helpers do what they say."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from audit_replay import ReplayServer

from kvfence.audit.base import Budget, CheckResult, Fact, Plot, PlotSeries, Verdict, worst
from kvfence.audit.checks.canary.check import (
    Planted,
    find_leak,
    fragments_from_chars,
    fragments_from_pieces,
)
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.contract import AuditContext, Check, run_check
from kvfence.audit.report import SCHEMA, to_html, to_json, to_junit
from kvfence.audit.runbook import AuditRun, TargetSummary, run_audit
from kvfence.audit.targets.base import Target, TargetFacts, parse_prometheus
from kvfence.audit.targets.openai import OpenAITarget


class Crashes(Check):
    name = "crashes"

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        raise RuntimeError("boom")


class Greedy(Check):
    name = "greedy"

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        client = ctx.client(target, "a")
        while True:
            client.get("/v1/models")


def test_a_crashing_check_is_inconclusive_never_pass(replay: ReplayServer) -> None:
    ctx = AuditContext()
    with ctx.open():
        res = run_check(Crashes(), ctx, OpenAITarget(replay.url))
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "RuntimeError: boom" in res.summary


def test_budget_exhaustion_is_inconclusive_and_stops_sending(replay: ReplayServer) -> None:
    replay.json("/v1/models", {"data": [{"id": "m"}]})
    ctx = AuditContext(budget=Budget(max_requests=5))
    with ctx.open():
        res = run_check(Greedy(), ctx, OpenAITarget(replay.url))
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "budget" in res.summary
    assert res.requests_sent == 5 and len(replay.seen) == 5


def test_capacity_is_inconclusive_when_the_pool_is_unknown(replay: ReplayServer) -> None:
    replay.json("/v1/models", {"data": [{"id": "m", "max_model_len": 4096}]})
    ctx = AuditContext()
    with ctx.open():
        res = run_check(CapacityCheck(), ctx, OpenAITarget(replay.url))
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "failing closed" in res.summary


def test_capacity_with_context_override(replay: ReplayServer) -> None:
    replay.file("/info", "tgi/2.2.0.info.json")  # max_batch_total_tokens 37872
    from kvfence.audit.targets.tgi import TgiTarget

    for context, want in ((30000, Verdict.PASS), (31000, Verdict.FAIL)):
        ctx = AuditContext(context_override=context)
        with ctx.open():
            res = run_check(CapacityCheck(), ctx, TgiTarget(replay.url))
        assert res.verdict is want, res.summary
    assert res.evidence["context_length"]["source"] == "--context (operator override)"


def test_unidentified_target_makes_every_check_inconclusive(replay: ReplayServer) -> None:
    ctx = AuditContext()
    with ctx.open():
        run = run_audit([replay.url], ctx, checks=("capacity", "canary"))
    assert [r.verdict for r in run.results] == [Verdict.INCONCLUSIVE] * 2
    assert run.exit_code() == 2 and run.exit_code(fail_on_inconclusive=False) == 0


def test_worst_and_exit_codes() -> None:
    assert worst([Verdict.PASS, Verdict.SKIPPED]) is Verdict.PASS
    assert worst([Verdict.PASS, Verdict.INCONCLUSIVE, Verdict.FAIL]) is Verdict.FAIL
    assert worst([]) is Verdict.SKIPPED
    only_skipped = _run([Verdict.SKIPPED])
    assert only_skipped.exit_code() == 2  # nothing verified is not a pass


def test_fact_unknown_and_as_int() -> None:
    assert not Fact.unknown("GET /x").known
    assert Fact(True, "s").as_int() is None
    assert Fact(4.0, "s").as_int() == 4


def test_fragments_cover_every_four_token_run() -> None:
    pieces = ["KV", "F-", "Q7", "ZP", "-3", "MX"]
    frags = fragments_from_pieces(pieces)
    assert "Q7ZP-3MX" in frags and "F-Q7ZP-3" in frags
    assert all(len(f) >= 4 for f in frags)
    planted = Planted("KVF-Q7ZP-3MX", frags, 10)
    assert find_leak("xx ZP-3MX yy", planted) is None  # 3 tokens: not enough
    assert find_leak("xx F-Q7ZP-3 yy", planted) == "F-Q7ZP-3"
    assert find_leak("KVF- alone", planted) is None  # the shared prefix proves nothing
    assert "Q7ZP-3MX" in fragments_from_chars("KVF-Q7ZP-3MX")


def test_a_fragment_of_digits_alone_is_not_a_leak() -> None:
    # Digit-by-digit tokens: the all-digit group 4821 is a 4-token run of its own.
    pieces = ["KV", "F-", "4", "8", "2", "1", "-Q", "7Z"]
    frags = fragments_from_pieces(pieces)
    assert "4821" not in frags and "F-4821" in frags
    planted = Planted("KVF-4821-Q7Z", frags, 10)
    assert find_leak('{"error": "seq 1948210337 gen 6"}', planted) is None
    assert find_leak("xx 4821-Q7Z yy", planted) == "4821-Q7Z"
    assert "4821-Q7Z" in fragments_from_chars("KVF-4821-Q7Z")
    assert all(any(c.isalpha() for c in f) for f in fragments_from_chars("KVF-4821-9306"))


def test_prometheus_parser_handles_labels_and_comments() -> None:
    text = '# HELP x y\nfoo{a="1",b="two words"} 3.5\nbar 2\nbad line\n'
    samples = parse_prometheus(text)
    assert [(s.name, s.labels, s.value) for s in samples] == [
        ("foo", {"a": "1", "b": "two words"}, 3.5),
        ("bar", {}, 2.0),
    ]


def _run(verdicts: list[Verdict]) -> AuditRun:
    plot_xy = Plot(
        "xy",
        "TTFT vs prompt length",
        "prompt tokens",
        "TTFT (s)",
        [
            PlotSeries("probes", [10, 100, 1000], [0.01, 0.05, 0.002], flags=[False, False, True]),
            PlotSeries("fit", [10, 1000], [0.01, 0.4], style="line"),
        ],
    )
    plot_hist = Plot(
        "hist",
        "hit vs miss",
        "TTFT (s)",
        series=[
            PlotSeries("shared prefix", [0.01, 0.012, 0.011], style="hist"),
            PlotSeries("fresh prefix", [0.05, 0.06, 0.055], style="hist"),
        ],
    )
    results = [
        CheckResult(
            f"c{i}", "http://t", v, f"summary <{v.value}>", {"n": i}, plots=[plot_xy, plot_hist]
        )
        for i, v in enumerate(verdicts)
    ]
    return AuditRun(
        targets=[
            TargetSummary(
                "http://t", "vllm", "auto: test", TargetFacts(Fact("vllm", "x")).to_json()
            )
        ],
        results=results,
        checks=tuple(r.check for r in results),
        started_at="2026-11-29T10:00:00+00:00",
        duration_s=1.5,
        requests_sent=42,
    )


def test_reports_are_well_formed(tmp_path: Path) -> None:
    run = _run([Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE, Verdict.SKIPPED])
    doc = json.loads(json.dumps(to_json(run)))
    assert doc["schema"] == SCHEMA and doc["exit_code"] == 1
    counts = {"pass": 1, "fail": 1, "inconclusive": 1, "skipped": 1, "not_applicable": 0}
    assert doc["counts"] == counts  # not_applicable: an additive key of kvfence.audit/1
    assert doc["results"][0]["plots"][0]["series"][0]["flags"] == [False, False, True]
    root = ET.fromstring(ET.tostring(to_junit(run)))
    assert root.get("tests") == "4" and root.get("failures") == "1"
    suite = root.find("testsuite")
    assert root.get("errors") == "1" and suite is not None and suite.get("skipped") == "1"
    case = root.find(".//testcase[@name='c1']")
    assert case is not None and case.find("failure") is not None
    page = to_html(run)
    assert "summary &lt;fail&gt;" in page  # escaped
    assert page.count("<svg") == 8 and "plot-hist" in page and 'class="fit"' in page
    assert 'class="flagged"' in page
    for external in ("<script", "<link", "src=", "href="):
        assert external not in page


def test_cli_on_a_dead_target_is_inconclusive_exit_2(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvfence.audit.cli import audit

    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        audit,
        ["--target", "http://127.0.0.1:9", "--quiet", "--json", str(out), "--checks", "capacity"],
    )
    assert res.exit_code == 2, res.output
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "inconclusive"
    error = doc["targets"][0]["error"]
    assert error.startswith("nothing answered at http://127.0.0.1:9 (ConnectError")
    assert "is the engine running" in error
    res = CliRunner().invoke(
        audit, ["--target", "http://127.0.0.1:9", "--quiet", "--no-fail-on-inconclusive"]
    )
    assert res.exit_code == 0


def test_cli_rejects_unknown_checks() -> None:
    from click.testing import CliRunner

    from kvfence.audit.cli import audit

    res = CliRunner().invoke(audit, ["--target", "http://127.0.0.1:9", "--checks", "nope"])
    assert res.exit_code == 2 and "unknown check" in res.output
