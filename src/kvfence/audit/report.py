"""Reports of an `AuditRun`: terminal table, JSON (versioned schema), JUnit XML, HTML.

JSON schema "kvfence.audit/1" (additive changes only; a breaking change
bumps the number):
  schema, tool{name, version}, started_at, duration_s, verdict, exit_code,
  counts{pass, fail, inconclusive, skipped, not_applicable}, requests_sent, settings{...},
  checks[...], targets[{url, engine, detected_by, facts, error, requests_sent}],
  results[{check, target, verdict, summary, evidence, requests_sent,
           duration_s, p_value, alpha (statistical checks; else null),
           plots[{kind, title, x_label, y_label, series, note}]}]

The HTML page is self-contained: inline CSS and SVG drawn here, no script,
no external asset.
"""

from __future__ import annotations

import html
import json
import math
import xml.etree.ElementTree as ET
from typing import Any

from rich.console import Console
from rich.table import Table

from kvfence import __version__
from kvfence.audit.base import CheckResult, JSONValue, Plot, PlotSeries, Verdict
from kvfence.audit.runbook import AuditRun

SCHEMA = "kvfence.audit/1"
COLOURS = {
    "pass": "#1a7f37",
    "fail": "#cf222e",
    "inconclusive": "#bf8700",
    "skipped": "#6e7781",
    "not_applicable": "#0969da",
}
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


def to_junit(run: AuditRun) -> ET.Element:
    """One <testsuite> per target, one <testcase> per check; fail → <failure>, inconclusive → <error>.

    not_applicable is a passing case (a deploy gate passes on it); its system-out names it.
    """
    suites = ET.Element("testsuites", name="kvfence audit")
    engines = {t.url: t.engine or "unknown" for t in run.targets}
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for t in run.targets:
        mine = [r for r in run.results if r.target == t.url]
        counts = {
            "tests": len(mine),
            "failures": sum(r.verdict is Verdict.FAIL for r in mine),
            "errors": sum(r.verdict is Verdict.INCONCLUSIVE for r in mine),
            "skipped": sum(r.verdict is Verdict.SKIPPED for r in mine),
        }
        for k, v in counts.items():
            totals[k] += v
        suite = ET.SubElement(
            suites,
            "testsuite",
            name=f"{engines[t.url]} {t.url}",
            time=f"{sum(r.duration_s for r in mine):.3f}",
            attrib={"timestamp": run.started_at, **{k: str(v) for k, v in counts.items()}},
        )
        for r in mine:
            case = ET.SubElement(
                suite,
                "testcase",
                classname=f"kvfence.audit.{engines[t.url]}",
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
    for k, v in totals.items():
        suites.set(k, str(v))
    suites.set("time", f"{run.duration_s:.3f}")
    return suites


def write_junit(run: AuditRun, path: str) -> None:
    tree = ET.ElementTree(to_junit(run))
    ET.indent(tree)
    tree.write(path, encoding="utf-8", xml_declaration=True)


# -- terminal ---------------------------------------------------------------------


def significance(r: CheckResult) -> str:
    """A statistical check's p-value and the alpha it was judged at ("" for the others)."""
    if r.alpha is None:
        return ""
    p = "n/a" if r.p_value is None else f"{r.p_value:.2g}"
    return f"{p} ({r.alpha:.2g})"


def print_summary(run: AuditRun, console: Console, fail_on_inconclusive: bool = True) -> None:
    for t in run.targets:
        how = t.detected_by or t.error or ""
        console.print(f"[bold]{t.url}[/] — {t.engine or 'unidentified'} ({how})")
    table = Table(title="kvfence audit", show_lines=False)
    for col in ("target", "check", "verdict", "requests", "time", "p (alpha)", "summary"):
        table.add_column(col, overflow="fold", no_wrap=col in ("verdict", "check"))
    for r in run.results:
        style = RICH_STYLES[r.verdict.value]
        table.add_row(
            r.target,
            r.check,
            f"[{style}]{r.verdict.value.upper()}[/]",
            str(r.requests_sent),
            f"{r.duration_s:.1f}s",
            significance(r),
            r.summary,
        )
    console.print(table)
    verdict = run.verdict.value
    console.print(
        f"verdict: [{RICH_STYLES[verdict]}]{verdict.upper()}[/] — "
        f"{run.requests_sent} requests in {run.duration_s:.1f}s, "
        f"exit code {run.exit_code(fail_on_inconclusive)}"
    )


# -- HTML + inline SVG --------------------------------------------------------------

W, H, PAD_L, PAD_R, PAD_T, PAD_B = 560, 300, 64, 16, 28, 44


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    start = math.ceil(lo / step) * step
    out: list[float] = []
    v = start
    while v <= hi + 1e-12 and len(out) < 20:
        out.append(round(v, 12))
        v += step
    return out


def _fmt(value: float) -> str:
    v = float(value)
    if v == 0:
        return "0"
    if abs(v) >= 1000 or v.is_integer():
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


class _Frame:
    """Maps data coordinates to the SVG box, draws axes."""

    def __init__(self, xs: list[float], ys: list[float], y_zero: bool = False) -> None:
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        self.y0, self.y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if y_zero:
            self.y0 = min(0.0, self.y0)
        for lo, hi in (("x0", "x1"), ("y0", "y1")):
            a, b = getattr(self, lo), getattr(self, hi)
            if a == b:
                setattr(self, lo, a - 1 if a else 0.0)
                setattr(self, hi, b + 1)
            else:
                pad = (b - a) * 0.05
                setattr(self, lo, a - pad if not (y_zero and lo == "y0") else a)
                setattr(self, hi, b + pad)

    def px(self, x: float) -> float:
        return PAD_L + (x - self.x0) / (self.x1 - self.x0) * (W - PAD_L - PAD_R)

    def py(self, y: float) -> float:
        return H - PAD_B - (y - self.y0) / (self.y1 - self.y0) * (H - PAD_T - PAD_B)

    def axes(self, x_label: str, y_label: str) -> list[str]:
        e = html.escape
        out = [
            f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" class="ax"/>',
            f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" class="ax"/>',
        ]
        for t in _ticks(self.x0, self.x1):
            x = self.px(t)
            out.append(
                f'<line x1="{x:.1f}" y1="{H - PAD_B}" x2="{x:.1f}" y2="{H - PAD_B + 4}" class="ax"/>'
            )
            out.append(
                f'<text x="{x:.1f}" y="{H - PAD_B + 16}" class="tick" text-anchor="middle">{_fmt(t)}</text>'
            )
        for t in _ticks(self.y0, self.y1):
            y = self.py(t)
            out.append(
                f'<line x1="{PAD_L - 4}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" class="grid"/>'
            )
            out.append(
                f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>'
            )
        out.append(
            f'<text x="{(PAD_L + W - PAD_R) / 2}" y="{H - 6}" class="lab" text-anchor="middle">{e(x_label)}</text>'
        )
        out.append(
            f'<text x="14" y="{(PAD_T + H - PAD_B) / 2}" class="lab" text-anchor="middle" '
            f'transform="rotate(-90 14 {(PAD_T + H - PAD_B) / 2})">{e(y_label)}</text>'
        )
        return out


PALETTE = ("#0969da", "#8250df", "#1a7f37", "#bc4c00", "#6e7781")


def _legend(series: list[PlotSeries]) -> list[str]:
    out = []
    x = PAD_L + 8
    for i, s in enumerate(series):
        c = PALETTE[i % len(PALETTE)]
        out.append(f'<rect x="{x}" y="8" width="10" height="10" fill="{c}" fill-opacity="0.7"/>')
        out.append(f'<text x="{x + 14}" y="17" class="tick">{html.escape(s.name)}</text>')
        # A long name widens its slot (about 7 px a character at 11 px) so labels never overlap.
        x += max(150, 28 + 7 * len(s.name))
    return out


def svg_xy(plot: Plot) -> str:
    xs = [x for s in plot.series if s.style != "hist" for x in s.x]
    ys = [y for s in plot.series if s.style != "hist" for y in s.y]
    f = _Frame(xs, ys, y_zero=True)
    body = f.axes(plot.x_label, plot.y_label)
    for i, s in enumerate(plot.series):
        c = PALETTE[i % len(PALETTE)]
        pts = list(zip(s.x, s.y, strict=False))
        if s.style == "line":
            path = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in sorted(pts))
            body.append(
                f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="2" class="fit"/>'
            )
            continue
        for j, (x, y) in enumerate(pts):
            flagged = j < len(s.flags) and s.flags[j]
            title = s.labels[j] if j < len(s.labels) else f"{_fmt(x)}, {_fmt(y)}"
            colour = COLOURS["fail"] if flagged else c
            r = 5 if flagged else 3
            body.append(
                f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="{r}" fill="{colour}" '
                f'fill-opacity="0.75" class="{"flagged" if flagged else "pt"}">'
                f"<title>{html.escape(title)}</title></circle>"
            )
    body += _legend(plot.series)
    return _svg(plot, body)


def svg_hist(plot: Plot, bins: int = 24) -> str:
    values = [v for s in plot.series for v in s.x]
    if not values:
        return _svg(plot, ['<text x="20" y="40" class="lab">no samples</text>'])
    lo, hi = min(values), max(values)
    width = (hi - lo) / bins if hi > lo else 1.0
    counts: list[list[float]] = []
    for s in plot.series:
        c = [0] * bins
        for v in s.x:
            c[min(bins - 1, int((v - lo) / width))] += 1
        n = max(1, len(s.x))
        counts.append([k / n for k in c])
    f = _Frame([lo, lo + width * bins], [0.0, max(max(c) for c in counts)], y_zero=True)
    body = f.axes(plot.x_label, plot.y_label or "fraction of requests")
    for i, fractions in enumerate(counts):
        colour = PALETTE[i % len(PALETTE)]
        for b, frac in enumerate(fractions):
            if frac == 0:
                continue
            x0, x1 = f.px(lo + b * width), f.px(lo + (b + 1) * width)
            y = f.py(frac)
            body.append(
                f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(1.0, x1 - x0 - 1):.1f}" '
                f'height="{H - PAD_B - y:.1f}" fill="{colour}" fill-opacity="0.45" class="bar"/>'
            )
    body += _legend(plot.series)
    return _svg(plot, body)


def svg_ladder(plot: Plot) -> str:
    """One row per rung: a bar as long as the prompt, green when answered right, red when not."""
    s = plot.series[0] if plot.series else PlotSeries("rungs")
    row_h, left, right = 30, 170, 190
    height = PAD_T + len(s.x) * row_h + 10
    longest = max((float(x) for x in s.x), default=1.0) or 1.0
    body = [
        f'<text x="8" y="18" class="lab">{html.escape(plot.x_label)} → {html.escape(plot.y_label)}</text>'
    ]
    for i, tokens in enumerate(s.x):
        y = PAD_T + i * row_h
        flagged = i < len(s.flags) and s.flags[i]
        colour = COLOURS["fail"] if flagged else COLOURS["pass"]
        status = int(s.y[i]) if i < len(s.y) else 0
        label = s.labels[i] if i < len(s.labels) else ""
        bar = max(2.0, float(tokens) / longest * (W - left - right))
        body.append(f'<text x="8" y="{y + 15}" class="tick">{html.escape(label)}</text>')
        body.append(
            f'<rect x="{left}" y="{y}" width="{bar:.1f}" height="{row_h - 8}" fill="{colour}" '
            f'fill-opacity="0.8" class="{"flagged" if flagged else "rung"}">'
            f"<title>{html.escape(label)}</title></rect>"
        )
        body.append(
            f'<text x="{left + bar + 6:.1f}" y="{y + 15}" class="tick">'
            f"{_fmt(tokens)} tok → HTTP {status or 'no answer'}</text>"
        )
    return _svg(plot, body, height)


def _svg(plot: Plot, body: list[str], height: int = H) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {height}" width="{W}" '
        f'height="{height}" role="img" aria-label="{html.escape(plot.title)}" class="plot plot-{plot.kind}">'
        + "".join(body)
        + "</svg>"
    )


def render_plot(plot: Plot) -> str:
    drawn = {"xy": svg_xy, "hist": svg_hist, "ladder": svg_ladder}[plot.kind](plot)
    note = f'<p class="note">{html.escape(plot.note)}</p>' if plot.note else ""
    return f"<figure><figcaption>{html.escape(plot.title)}</figcaption>{drawn}{note}</figure>"


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


def _badge(v: str) -> str:
    return f'<span class="v v-{v}">{html.escape(v)}</span>'


def to_html(run: AuditRun, fail_on_inconclusive: bool = True) -> str:
    e = html.escape
    verdict = run.verdict.value
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>kvfence audit — {e(verdict)}</title><style>{CSS}</style></head><body>",
        f"<h1>kvfence audit {_badge(verdict)}</h1>",
        f"<p>{e(run.started_at)} · {len(run.targets)} target(s) · {run.requests_sent} requests · "
        f"{run.duration_s:.1f}s · exit code {run.exit_code(fail_on_inconclusive)} · schema {SCHEMA}</p>",
        "<table><tr><th>target</th><th>check</th><th>verdict</th><th>requests</th>"
        "<th>p (alpha)</th><th>summary</th></tr>",
    ]
    for r in run.results:
        parts.append(
            f"<tr><td>{e(r.target)}</td><td>{e(r.check)}</td><td>{_badge(r.verdict.value)}</td>"
            f"<td>{r.requests_sent}</td><td>{e(significance(r))}</td><td>{e(r.summary)}</td></tr>"
        )
    parts.append("</table>")
    for t in run.targets:
        parts.append(f"<h2>{e(t.url)} — {e(t.engine or 'unidentified')}</h2>")
        parts.append(f"<p>{e(t.detected_by or t.error or '')}</p>")
        if t.error and t.detected_by:
            parts.append(f"<p>{e(t.error)}</p>")
        if isinstance(t.facts, dict):
            parts.append("<table><tr><th>fact</th><th>value</th><th>source</th></tr>")
            for name, fact in t.facts.items():
                if isinstance(fact, dict) and "source" in fact:
                    parts.append(_fact_row(name, fact))
                elif isinstance(fact, dict):
                    for sub, f in fact.items():
                        if isinstance(f, dict):
                            parts.append(_fact_row(f"{name}.{sub}", f))
            parts.append("</table>")
        for r in (r for r in run.results if r.target == t.url):
            parts.append(f"<h3>{e(r.check)} {_badge(r.verdict.value)}</h3><p>{e(r.summary)}</p>")
            parts.extend(render_plot(p) for p in r.plots)
            if r.evidence:
                parts.append(
                    "<details><summary>evidence</summary><pre>"
                    + e(json.dumps(r.evidence, indent=2, default=str))
                    + "</pre></details>"
                )
    parts.append("</body></html>")
    return "\n".join(parts)


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
