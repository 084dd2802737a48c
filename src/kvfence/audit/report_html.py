"""The report as one self-contained HTML page: inline CSS and SVG, no script, no external asset."""

from __future__ import annotations

import html
import json
from typing import Any

from kvfence.audit.base import CheckResult
from kvfence.audit.report_svg import render_plot
from kvfence.audit.runbook import AuditRun, TargetSummary

SCHEMA = "kvfence.audit/1"

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#1f2328;max-width:1200px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px} h3{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;width:100%;margin:8px 0} td,th{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa} .v{font-weight:700;text-transform:uppercase;color:#fff;padding:2px 8px;border-radius:10px;font-size:12px}
.v-pass{background:#1a7f37}.v-fail{background:#cf222e}.v-inconclusive{background:#bf8700}.v-skipped{background:#6e7781}.v-not_applicable{background:#0969da}
details{margin:4px 0} pre{background:#f6f8fa;padding:8px;overflow:auto;max-height:360px;font-size:12px}
figure{display:inline-block;margin:8px 16px 8px 0;border:1px solid #d0d7de;padding:6px;border-radius:6px}
figcaption{font-weight:600;margin-bottom:4px} .note{color:#57606a;font-size:12px;margin:4px 0 0}
svg .ax{stroke:#57606a} svg .grid{stroke:#eaeef2} svg .tick{font-size:11px;fill:#57606a} svg .lab{font-size:12px;fill:#1f2328}
.fact-src{color:#57606a;font-size:12px}
"""


def significance(r: CheckResult) -> str:
    """A statistical check's p-value and the alpha it was judged at ("" for the others)."""
    if r.alpha is None:
        return ""
    p = "n/a" if r.p_value is None else f"{r.p_value:.2g}"
    return f"{p} ({r.alpha:.2g})"


def target_line(t: TargetSummary) -> str:
    """Where a target is and how its engine is known (why not: `outcome_lines`)."""
    if t.engine is None:
        return f"{t.url} — not identified, not audited"
    return f"{t.url} — {t.engine} ({t.detected_by or 'engine given'})"


def verdict_grid(run: AuditRun) -> dict[tuple[str, str], str]:
    """(target URL, check) -> verdict."""
    return {(r.target, r.check): r.verdict.value for r in run.results}


def outcome_lines(run: AuditRun) -> list[str]:
    """One line per target naming every check that failed (and any left inconclusive), or
    why the target was not audited at all: the reason once, not once per check."""
    lines = []
    for t in run.targets:
        if t.engine is None:
            lines.append(f"{t.label} not audited: {t.error or 'engine not identified'}")
            continue
        mine = run.results_of(t)
        failed = [r.check for r in mine if r.verdict.value == "fail"]
        undecided = [r.check for r in mine if r.verdict.value == "inconclusive"]
        line = f"{t.label} fails: {', '.join(failed) or 'nothing'}"
        if undecided:
            line += f"; inconclusive: {', '.join(undecided)}"
        lines.append(line)
    return lines


def _badge(v: str) -> str:
    return f'<span class="v v-{v}">{html.escape(v)}</span>'


def to_html(run: AuditRun, fail_on_inconclusive: bool = True) -> str:
    e = html.escape
    verdict = run.verdict.value
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>kvfence audit — {e(verdict)} — {e(', '.join(t.label for t in run.targets))}"
        f"</title><style>{CSS}</style></head><body>",
        f"<h1>kvfence audit {_badge(verdict)}</h1>",
        f"<p>{e(run.started_at)} · {len(run.targets)} target(s) · {run.requests_sent} requests · "
        f"{run.duration_s:.1f}s · exit code {run.exit_code(fail_on_inconclusive)} · schema {SCHEMA}</p>",
        *_side_by_side(run),
        "<ul class=outcome>",
        *(f"<li>{e(line)}</li>" for line in outcome_lines(run)),
        "</ul>",
        "<table><tr><th>target</th><th>check</th><th>verdict</th><th>requests</th>"
        "<th>p (alpha)</th><th>summary</th></tr>",
    ]
    for r in run.results:
        parts.append(
            f"<tr><td>{e(run.name_of(r.target))}</td><td>{e(r.check)}</td>"
            f"<td>{_badge(r.verdict.value)}</td><td>{r.requests_sent}</td>"
            f"<td>{e(significance(r))}</td><td>{e(r.summary)}</td></tr>"
        )
    parts.append("</table>")
    for t in run.targets:
        parts += _target_section(t, run.results_of(t))
    parts.append("</body></html>")
    return "\n".join(parts)


def _side_by_side(run: AuditRun) -> list[str]:
    """Checks down, targets across, each column headed by its target's name."""
    e = html.escape
    grid = verdict_grid(run)
    head = "".join(f"<th class=target-name>{e(t.label)}</th>" for t in run.targets)
    rows = [f"<table class=side-by-side><tr><th>check</th>{head}</tr>"]
    for check in run.checks:
        cells = "".join(
            f"<td>{_badge(grid[(t.url, check)]) if (t.url, check) in grid else '-'}</td>"
            for t in run.targets
        )
        rows.append(f"<tr><td>{e(check)}</td>{cells}</tr>")
    rows.append("</table>")
    return rows


def _target_section(t: TargetSummary, results: list[CheckResult]) -> list[str]:
    e = html.escape
    parts = [f"<h2>{e(t.label)}</h2>", f"<p>{e(target_line(t))}</p>"]
    if t.error:
        parts.append(f"<p>{e(t.error)}</p>")
    if isinstance(t.facts, dict):
        parts += _facts_table(t.facts)
    for r in results:
        parts.append(f"<h3>{e(r.check)} {_badge(r.verdict.value)}</h3><p>{e(r.summary)}</p>")
        parts.extend(render_plot(p) for p in r.plots)
        if r.evidence:
            parts.append(
                "<details><summary>evidence</summary><pre>"
                + e(json.dumps(r.evidence, indent=2, default=str))
                + "</pre></details>"
            )
    return parts


def _facts_table(facts: dict[str, Any]) -> list[str]:
    parts = ["<table><tr><th>fact</th><th>value</th><th>source</th></tr>"]
    for name, fact in facts.items():
        if isinstance(fact, dict) and "source" in fact:
            parts.append(_fact_row(name, fact))
        elif isinstance(fact, dict):
            for sub, f in fact.items():
                if isinstance(f, dict):
                    parts.append(_fact_row(f"{name}.{sub}", f))
    parts.append("</table>")
    return parts


def _fact_row(name: str, fact: dict[str, Any]) -> str:
    e = html.escape
    value = "unknown" if fact.get("value") is None else str(fact["value"])
    note = f" — {fact['note']}" if fact.get("note") else ""
    return (
        f"<tr><td>{e(name)}</td><td>{e(value)}</td>"
        f'<td class="fact-src">{e(str(fact.get("source", "")))}{e(note)}</td></tr>'
    )


def write_html(run: AuditRun, path: str, fail_on_inconclusive: bool = True) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_html(run, fail_on_inconclusive))
