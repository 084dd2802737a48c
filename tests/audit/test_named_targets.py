"""Named targets in every report: `--target NAME=URL`, the terminal, HTML, JSON and JUnit.

The run below has the embedded demo's shape: two kvfence targets on loopback, seven checks
each, the lab failing five of them. Its JUnit file is validated against the Jenkins xunit
schema (fixtures/junit, with provenance) and read the way GitLab keys cases.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import xmlschema
from click.testing import CliRunner
from rich.console import Console

from kvfence.audit import report
from kvfence.audit.base import CheckResult, Verdict
from kvfence.audit.cli import audit
from kvfence.audit.runbook import AuditRun, TargetSummary
from kvfence.audit.target_names import TargetSpec, TargetSpecError, junit_classnames, parse_target

XSD = Path(__file__).parent / "fixtures" / "junit" / "jenkins-xunit-junit-10.xsd"
LAB, HARDENED = "incident lab (workers-ai-2026)", "hardened"
LAB_URL, HARDENED_URL = "http://127.0.0.1:41001", "http://127.0.0.1:41002"
LAB_FAILS = ("capacity", "boundary", "canary", "noninterference", "latency")
# The seven checks the demo's report held when GitLab kept only 7 of its 14 cases.
CHECKS = (*LAB_FAILS, "prefix_sharing", "counters")


def demo_shaped_run() -> AuditRun:
    results = []
    for url, name in ((LAB_URL, LAB), (HARDENED_URL, HARDENED)):
        for check in CHECKS:
            failed = url == LAB_URL and check in LAB_FAILS
            verdict = Verdict.FAIL if failed else Verdict.PASS
            if check == "prefix_sharing":
                verdict = Verdict.SKIPPED
            results.append(CheckResult(check, url, verdict, f"{check} said so", target_name=name))
    return AuditRun(
        targets=[
            TargetSummary(LAB_URL, "kvfence", "started here", name=LAB),
            TargetSummary(HARDENED_URL, "kvfence", "started here", name=HARDENED),
        ],
        results=results,
        checks=CHECKS,
        started_at="2026-12-06T03:00:00+00:00",
        duration_s=100.0,
        requests_sent=900,
    )


def test_a_target_is_a_url_or_name_equals_url() -> None:
    assert parse_target("http://10.0.0.5:8000/") == TargetSpec(
        "http://10.0.0.5:8000", "http://10.0.0.5:8000"
    )
    assert parse_target("prod prefill=https://p:8000") == TargetSpec(
        "prod prefill", "https://p:8000"
    )
    for bad in ("10.0.0.5:8000", "lab=", "=http://x", "lab=ftp://x"):
        with pytest.raises(TargetSpecError, match="neither an http"):
            parse_target(bad)


def test_the_cli_refuses_a_bad_or_repeated_target_name_before_sending_anything() -> None:
    res = CliRunner().invoke(audit, ["--target", "10.0.0.5:8000", "--quiet"])
    assert res.exit_code == 2 and "NAME=URL" in res.output, res.output
    twice = ["--target", "a=http://127.0.0.1:9", "--target", "a=http://127.0.0.1:10"]
    res = CliRunner().invoke(audit, [*twice, "--quiet"])
    assert res.exit_code == 2 and "named 'a'" in res.output, res.output


def test_a_named_dead_target_is_reported_by_its_name(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    target = "edge node=http://127.0.0.1:9"
    res = CliRunner().invoke(audit, ["--target", target, "--quiet", "--json", str(out)])
    assert res.exit_code == 2, res.output
    doc = json.loads(out.read_text())
    assert doc["targets"][0]["name"] == "edge node"
    assert {r["target_name"] for r in doc["results"]} == {"edge node"}


def test_junit_validates_against_the_jenkins_xunit_schema(tmp_path: Path) -> None:
    path = tmp_path / "audit.xml"
    report.write_junit(demo_shaped_run(), str(path))
    xmlschema.XMLSchema(str(XSD)).validate(str(path))  # raises on the first violation
    root = ET.parse(path).getroot()
    assert root.get("tests") == "14" and root.get("failures") == "5"
    skipped = {s.get("name"): s.get("skipped") for s in root.iter("testsuite")}
    assert skipped == {LAB: "1", HARDENED: "1"}  # counted per suite, where the schema allows


def test_the_schema_fixture_rejects_skipped_on_testsuites() -> None:
    """The fixture holds the constraint the writer was broken on (else the test above is empty)."""
    doc = '<testsuites tests="1" skipped="0"><testsuite tests="1"/></testsuites>'
    assert not xmlschema.XMLSchema(str(XSD)).is_valid(doc)


def test_gitlab_keeps_every_case_of_two_targets_on_one_engine() -> None:
    """GitLab keys a case by classname + name within a job: 14 cases must be 14 keys."""
    root = report.to_junit(demo_shaped_run())
    cases = list(root.iter("testcase"))
    assert len(cases) == 14
    assert len({(c.get("classname"), c.get("name")) for c in cases}) == 14
    by_suite = {s.get("name"): {c.get("classname") for c in s.iter("testcase")} for s in root}
    assert by_suite == {
        LAB: {"kvfence.audit.incident_lab_workers-ai-2026"},
        HARDENED: {"kvfence.audit.hardened"},
    }


def test_classnames_stay_distinct_when_names_meet_after_cleaning() -> None:
    names = ["a b", "a_b", "http://10.0.0.1:80"]
    got = junit_classnames(names)
    assert len(set(got.values())) == 3
    assert got["http://10.0.0.1:80"] == "kvfence.audit.http_10_0_0_1_80"  # no package dots


def test_terminal_names_both_targets_side_by_side_and_every_failed_check() -> None:
    console = Console(record=True, width=200)
    report.print_summary(demo_shaped_run(), console)
    text = console.export_text()
    header = next(line for line in text.splitlines() if "check" in line and HARDENED in line)
    assert LAB in header  # one column per target, by name
    assert f"{LAB}: {LAB_URL} — kvfence (started here)" in text
    assert f"{LAB} fails: {', '.join(LAB_FAILS)}" in text  # noninterference included
    assert f"{HARDENED} fails: nothing" in text


def test_html_names_both_targets_side_by_side() -> None:
    page = report.to_html(demo_shaped_run())
    assert page.count("<th class=target-name>") == 2
    head = page.index("<table class=side-by-side>")
    assert page.index(f"<th class=target-name>{LAB}</th>", head) < page.index(
        f"<th class=target-name>{HARDENED}</th>", head
    )
    assert f"<h2>{LAB}</h2>" in page and f"<h2>{HARDENED}</h2>" in page
    assert f"<li>{LAB} fails: {', '.join(LAB_FAILS)}</li>" in page


def test_the_quiet_line_is_text_not_a_python_dict() -> None:
    line = report.quiet_line(demo_shaped_run())
    assert line.startswith("kvfence audit: FAIL (7 pass, 5 fail, 2 skipped; 900 requests) exit 1")
    assert f"{LAB} fails: {', '.join(LAB_FAILS)}" in line
    assert not set("{}'") & set(line), line


def test_the_main_job_says_which_required_check_did_not_fire() -> None:
    from kvfence.cli import demo_outcome

    run = demo_shaped_run()
    assert demo_outcome(json.loads(json.dumps(report.to_json(run)))) == ([], True)
    for r in run.results:
        if r.target == LAB_URL and r.check == "latency":
            r.verdict = Verdict.PASS
    lines, as_expected = demo_outcome(json.loads(json.dumps(report.to_json(run))))
    assert lines == [f"{LAB} does not fail: latency"] and not as_expected
