"""The runbook against real kvfence servers: green on the hardened engine, red on the lab's bug.

Each check is shown to fire on the switches that break what it checks and to
stay quiet when the defences are on (through real `kvfence serve` processes,
the audit reaching them over HTTP only, via the real `kvfence audit` command).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from audit_servers import KEY_A, KEY_B, KEY_OP, Server
from click.testing import CliRunner

from kvfence.audit.base import Budget, Fact
from kvfence.audit.checks.boundary.check import BoundaryCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.kvfence import KvfenceTarget
from kvfence.cli import main

pytestmark = pytest.mark.slow
CHECKS = "capacity,boundary,canary,counters"


@dataclass
class Audited:
    exit_code: int
    output: str
    report: dict[str, Any]
    junit: ET.Element
    html: str

    def verdict(self, check: str) -> str:
        (r,) = [r for r in self.report["results"] if r["check"] == check]
        return str(r["verdict"])

    def result(self, check: str) -> dict[str, Any]:
        (r,) = [r for r in self.report["results"] if r["check"] == check]
        return r


def run_cli(server: Server, out: Path) -> Audited:
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "audit", "--target", server.url, "--key-a", KEY_A, "--key-b", KEY_B, "--operator-key", KEY_OP,
        "--checks", CHECKS, "--quiet", "--max-requests", "600",
        "--json", str(out / "a.json"), "--junit", str(out / "a.xml"), "--report", str(out / "a.html"),
    ]  # fmt: skip
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    return Audited(
        res.exit_code,
        res.output,
        json.loads((out / "a.json").read_text()),
        ET.parse(out / "a.xml").getroot(),
        (out / "a.html").read_text(),
    )


@pytest.fixture(scope="module")
def audits(
    kvfence_servers: dict[str, Server], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Audited]:
    tmp = tmp_path_factory.mktemp("audits")
    return {name: run_cli(s, tmp / name) for name, s in kvfence_servers.items()}


def test_hardened_engine_passes_every_check(audits: dict[str, Audited]) -> None:
    a = audits["hardened"]
    assert a.exit_code == 0, a.output
    for check in CHECKS.split(","):
        assert a.verdict(check) == "pass", a.result(check)
    assert a.report["targets"][0]["engine"] == "kvfence"
    assert "GET /server_info" in a.report["targets"][0]["detected_by"]


def test_capacity_fails_on_undersized_pool_with_sources_and_fixes(
    audits: dict[str, Audited],
) -> None:
    r = audits["undersized"].result("capacity")
    assert r["verdict"] == "fail"
    ev = r["evidence"]
    assert ev["pool_tokens"] == {
        "value": 336,
        "source": "GET /server_info max_total_num_tokens",
        "note": "the smallest prefill KV pool, in tokens",
    }
    assert ev["context_length"]["value"] == 512
    assert ev["shortfall_tokens"] == 640 - 336
    assert any("≤ 268" in fix for fix in ev["fixes"])  # 336 / 1.25


def test_one_switch_alone_is_caught_by_the_gate_but_leaks_nothing(
    audits: dict[str, Audited],
) -> None:
    """Defence in depth: with only the gate skipped, the other defences turn the
    over-pool request into a clean error — boundary and canary stay green."""
    a = audits["undersized"]
    assert a.exit_code == 1
    assert a.verdict("boundary") == "pass", a.result("boundary")["summary"]
    assert a.verdict("canary") == "pass", a.result("canary")["summary"]


def test_incident_combination_fails_boundary_and_canary(audits: dict[str, Audited]) -> None:
    a = audits["incident"]
    assert a.exit_code == 1
    assert a.verdict("capacity") == "fail"
    boundary = a.result("boundary")
    assert boundary["verdict"] == "fail"
    bad = {row["rung"] for row in boundary["evidence"]["rungs"] if row["verdict"] == "fail"}
    assert "pool + 1" in bad  # the incident's window: admitted, larger than the pool, answered 200
    canary = a.result("canary")
    assert canary["verdict"] == "fail"
    hit = canary["evidence"]["hits"][0]
    # The exact request pair: A's sentinel, and B's request that carried it back.
    assert hit["matched"] in hit["context"]
    assert hit["tenant_a_request"]["sentinel"].startswith(hit["matched"][:4]) or (
        hit["matched"] in hit["tenant_a_request"]["sentinel"]
    )
    assert hit["tenant_b_request"]["status"] == 200
    assert "prompt" in hit["tenant_b_request"]["request"]


def test_json_report_schema(audits: dict[str, Audited]) -> None:
    rep = audits["incident"].report
    assert rep["schema"] == "kvfence.audit/1"
    for key in ("tool", "started_at", "verdict", "exit_code", "counts", "requests_sent", "targets"):
        assert key in rep
    assert rep["verdict"] == "fail" and rep["exit_code"] == 1
    assert 0 < rep["requests_sent"] <= 600
    assert rep["targets"][0]["requests_sent"] > 0  # detection + facts are counted too
    assert rep["requests_sent"] == rep["targets"][0]["requests_sent"] + sum(
        r["requests_sent"] for r in rep["results"]
    )
    facts = rep["targets"][0]["facts"]
    assert facts["pool_tokens"]["value"] == 336
    assert facts["extra"]["lab_faults"]["value"].count(",") == 3  # the lab says it is a lab


def test_junit_has_one_case_per_check_and_maps_verdicts(audits: dict[str, Audited]) -> None:
    root = audits["incident"].junit
    cases = root.findall(".//testcase")
    assert sorted(c.get("name") or "" for c in cases) == sorted(CHECKS.split(","))
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    assert {"capacity", "boundary", "canary"} <= failed
    assert root.get("failures") == str(len(failed))
    hardened = audits["hardened"].junit
    assert hardened.get("failures") == "0" and hardened.get("errors") == "0"


def test_html_report_is_self_contained_with_the_boundary_ladder(
    audits: dict[str, Audited],
) -> None:
    page = audits["incident"].html
    assert page.startswith("<!doctype html>")
    assert "<svg" in page and "plot-ladder" in page
    assert 'class="flagged"' in page  # the failing rungs are drawn red
    for external in ("<script", "<link", "src=", "href=", "@import"):
        assert external not in page


@pytest.mark.parametrize(("server", "want"), [("hardened", "pass"), ("incident", "fail")])
def test_boundary_without_tokenize_calibrates_exact_text_prompts(
    kvfence_servers: dict[str, Server], server: str, want: str
) -> None:
    """Engines without /tokenize: prompts calibrated from usage.prompt_tokens, still token-exact."""
    target = KvfenceTarget(kvfence_servers[server].url)
    ctx = AuditContext(
        key_a=KEY_A, key_b=KEY_B, operator_key=KEY_OP, budget=Budget(max_requests=200)
    )
    with ctx.open():
        facts = target.facts(ctx.client(target, "b"))
        facts.tokenizer = Fact("calibrated from usage.prompt_tokens", "test: /tokenize ignored")
        res = run_check(BoundaryCheck(), ctx, target)
    assert res.verdict.value == want, res.summary
    rungs = res.evidence["rungs"]
    assert all(r["exact"] for r in rungs)
    accepted = [r for r in rungs if r["status"] == 200 and r["expect"] == "accept"]
    assert accepted and all(
        r["response"]["usage"]["prompt_tokens"] == r["tokens"] for r in accepted
    )
