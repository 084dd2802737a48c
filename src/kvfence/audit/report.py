"""Reports of an `AuditRun`: terminal table, JSON (versioned schema), JUnit XML, HTML.

JSON schema "kvfence.audit/1" (additive changes only; a breaking change
bumps the number):
  schema, tool{name, version}, started_at, duration_s, verdict, exit_code,
  counts{pass, fail, inconclusive, skipped, not_applicable}, requests_sent, settings{...},
  checks[...], targets[{url, engine, detected_by, facts, error, requests_sent}],
  results[{check, target, verdict, summary, evidence, requests_sent,
           duration_s, p_value, alpha (statistical checks; else null),
           plots[{kind, title, x_label, y_label, series, note}]}]

The HTML page (report_html.py, plots in report_svg.py) is self-contained: inline CSS and SVG, no script,
no external asset.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvfence import __version__
from kvfence.audit.base import CheckResult, JSONValue, Verdict
from kvfence.audit.report_html import (
    SCHEMA,
    outcome_lines,
    significance,
    target_line,
    to_html,
    verdict_grid,
    write_html,
)
from kvfence.audit.report_svg import COLOURS, PALETTE, render_plot
from kvfence.audit.runbook import AuditRun
from kvfence.audit.target_names import junit_classnames

__all__ = [
    "COLOURS",
    "PALETTE",
    "SCHEMA",
    "outcome_lines",
    "print_summary",
    "quiet_line",
    "render_plot",
    "significance",
    "to_html",
    "to_json",
    "to_junit",
    "write_html",
    "write_json",
    "write_junit",
]
RICH_STYLES = {
    "pass": "bold green",
    "fail": "bold red",
    "inconclusive": "bold yellow",
    "skipped": "dim",
    "not_applicable": "bold blue",
}


# -- JSON -------------------------------------------------------------------------


def to_json(run: AuditRun, fail_on_inconclusive: bool = True) -> dict[str, JSONValue]:
    return {
        "schema": SCHEMA,
        "tool": {"name": "kvfence", "version": __version__},
        "started_at": run.started_at,
        "duration_s": round(run.duration_s, 3),
        "verdict": run.verdict.value,
        "exit_code": run.exit_code(fail_on_inconclusive),
        "counts": run.counts(),
        "requests_sent": run.requests_sent,
        "settings": run.settings,
        "checks": list(run.checks),
        "targets": [t.to_json() for t in run.targets],
        "results": [r.to_json() for r in run.results],
    }


def write_json(run: AuditRun, path: str, fail_on_inconclusive: bool = True) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_json(run, fail_on_inconclusive), f, indent=2, sort_keys=False, default=str)
        f.write("\n")


# -- JUnit XML --------------------------------------------------------------------


# The attributes the Jenkins xunit schema (junit-10.xsd) allows on <testsuites>: `skipped`
# is a <testsuite> attribute only, and a file carrying it on <testsuites> fails validation.
TESTSUITES_COUNTS = ("tests", "failures", "errors")


def to_junit(run: AuditRun) -> ET.Element:
    """One <testsuite> per target, one <testcase> per check; fail → <failure>, inconclusive → <error>.

    Each target's cases carry its own classname (`kvfence.audit.<name>`): CI parsers key a
    case by classname and name, so one classname for all targets kept only one target's cases.
    not_applicable is a passing case (a deploy gate passes on it); its system-out names it.
    """
    suites = ET.Element("testsuites", name="kvfence audit")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    classnames = junit_classnames([t.label for t in run.targets])
    for t in run.targets:
        mine = run.results_of(t)
        counts = _junit_counts(mine)
        for k, v in counts.items():
            totals[k] += v
        suite = ET.SubElement(
            suites,
            "testsuite",
            name=t.label,
            time=f"{sum(r.duration_s for r in mine):.3f}",
            attrib={"timestamp": run.started_at, **{k: str(v) for k, v in counts.items()}},
        )
        props = ET.SubElement(suite, "properties")
        for key, value in (("url", t.url), ("engine", t.engine or "unidentified")):
            ET.SubElement(props, "property", name=key, value=value)
        for r in mine:
            _junit_case(suite, classnames[t.label], r)
        if t.error:
            ET.SubElement(suite, "system-err").text = t.error
    for k in TESTSUITES_COUNTS:
        suites.set(k, str(totals[k]))
    suites.set("time", f"{run.duration_s:.3f}")
    return suites


def _junit_counts(results: list[CheckResult]) -> dict[str, int]:
    return {
        "tests": len(results),
        "failures": sum(r.verdict is Verdict.FAIL for r in results),
        "errors": sum(r.verdict is Verdict.INCONCLUSIVE for r in results),
        "skipped": sum(r.verdict is Verdict.SKIPPED for r in results),
    }


def _junit_case(suite: ET.Element, classname: str, r: CheckResult) -> None:
    case = ET.SubElement(
        suite,
        "testcase",
        classname=classname,
        name=r.check,
        time=f"{r.duration_s:.3f}",
    )
    detail = json.dumps(r.evidence, indent=2, default=str)
    if r.verdict is Verdict.FAIL:
        el = ET.SubElement(case, "failure", message=r.summary, type="fail")
        el.text = detail
    elif r.verdict is Verdict.INCONCLUSIVE:
        el = ET.SubElement(case, "error", message=r.summary, type="inconclusive")
        el.text = detail
    elif r.verdict is Verdict.SKIPPED:
        ET.SubElement(case, "skipped", message=r.summary)
    out = ET.SubElement(case, "system-out")
    out.text = f"{r.verdict.value}: {r.summary} ({r.requests_sent} requests)"


def write_junit(run: AuditRun, path: str) -> None:
    tree = ET.ElementTree(to_junit(run))
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)


# -- terminal ---------------------------------------------------------------------


def print_summary(run: AuditRun, console: Console, fail_on_inconclusive: bool = True) -> None:
    for t in run.targets:
        named = f"[bold]{escape(t.name)}[/]: " if t.name and t.name != t.url else ""
        console.print(named + escape(target_line(t)))
    if len(run.targets) > 1:
        console.print(_side_by_side(run))
    table = Table(title="kvfence audit", show_lines=False)
    for col in ("target", "check", "verdict", "requests", "time", "p (alpha)", "summary"):
        table.add_column(col, overflow="fold", no_wrap=col in ("verdict", "check"))
    for r in run.results:
        style = RICH_STYLES[r.verdict.value]
        table.add_row(
            escape(run.name_of(r.target)),
            r.check,
            f"[{style}]{r.verdict.value.upper()}[/]",
            str(r.requests_sent),
            f"{r.duration_s:.1f}s",
            significance(r),
            escape(r.summary),
        )
    console.print(table)
    verdict = run.verdict.value
    console.print(
        f"verdict: [{RICH_STYLES[verdict]}]{verdict.upper()}[/] — "
        f"{run.requests_sent} requests in {run.duration_s:.1f}s, "
        f"exit code {run.exit_code(fail_on_inconclusive)}"
    )
    for line in outcome_lines(run):
        console.print(escape(line))


def _side_by_side(run: AuditRun) -> Table:
    """Checks down, targets across: each target's verdicts in its own named column."""
    table = Table(title="verdicts by target")
    table.add_column("check", no_wrap=True)
    for t in run.targets:
        table.add_column(escape(t.label), no_wrap=True)
    verdicts = verdict_grid(run)
    for check in run.checks:
        row = [check]
        for t in run.targets:
            v = verdicts.get((t.url, check))
            row.append(f"[{RICH_STYLES[v]}]{v.upper()}[/]" if v else "-")
        table.add_row(*row)
    return table


def quiet_line(run: AuditRun, fail_on_inconclusive: bool = True) -> str:
    """The one-line `--quiet` summary: the verdict, the counts in words, each target's failures."""
    counts = ", ".join(f"{n} {v.replace('_', ' ')}" for v, n in run.counts().items() if n)
    line = (
        f"kvfence audit: {run.verdict.value.upper()} ({counts or 'no checks'}; "
        f"{run.requests_sent} requests) exit {run.exit_code(fail_on_inconclusive)}"
    )
    return "; ".join([line, *outcome_lines(run)])
