"""The report's plots as inline SVG: scatter and fit lines, histograms, the context ladder.

Drawn here from the `Plot` values a check records, so the HTML page needs no script and no
external asset.
"""

from __future__ import annotations

import html
import math

from kvfence.audit.base import Plot, PlotSeries

COLOURS = {
    "pass": "#1a7f37",
    "fail": "#cf222e",
    "inconclusive": "#bf8700",
    "skipped": "#6e7781",
    "not_applicable": "#0969da",
}
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
