"""The HTML report, opened in headless Chromium: its plots are drawn, not just written.

The report comes from real audit results: capacity and boundary run through
`run_audit` against the real incident `kvfence serve` (its boundary ladder has
red rungs), prefix sharing against the same server (B's shared-vs-fresh TTFT
histograms), and the prefill-latency analysis of a seeded request log in which
a few long prompts were answered as fast as short ones (TTFT vs length with
the fit line and red flagged points). Chromium (Debian's `chromium`,
`make browser`) dumps the DOM it built and screenshots the page; the test
asserts the SVG plot elements exist with their data points and that the
screenshot shows the plots' colours in quantity. The test skips only when
/usr/bin/chromium is missing and KVFENCE_REQUIRE_BROWSER is not set (CI sets it).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import struct
import subprocess
import zlib
from collections import Counter
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from audit_servers import KEY_A, KEY_B, KEY_OP, Server

from kvfence.audit import report
from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.latency.check import analyse_log
from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.runbook import AuditRun, TargetSummary, run_audit
from kvfence.audit.stats import SequentialDesign
from kvfence.audit.target_names import TargetSpec
from kvfence.audit.targets.kvfence import KvfenceTarget

# Under a loaded machine the servers, the audit and two browser runs take minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHROMIUM = Path("/usr/bin/chromium")
# Tall enough for the whole report: the last plot ends near 3,100 px (below the verdicts by
# target and each target's failures).
WINDOW = (1280, 3800)
LAB_NAME, LOG_NAME = "incident lab (workers-ai-2026)", "request log"


def chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    reason = f"{CHROMIUM} not installed (run `make browser`: Debian's chromium package)"
    if os.environ.get("KVFENCE_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + "; KVFENCE_REQUIRE_BROWSER=1 forbids skipping")
    pytest.skip(reason)


def browser(page: Path, profile: Path, *mode: str) -> subprocess.CompletedProcess[bytes]:
    """Headless Chromium on a local file: no network, no sync, a fresh profile."""
    cmd = [
        str(chromium()),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--hide-scrollbars",
        "--force-color-profile=srgb",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        *mode,
        page.resolve().as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, timeout=180, check=False)


# -- a realistic report -----------------------------------------------------------


def latency_log(path: Path, seed: int = 0) -> None:
    """A seeded vLLM-style request log (FinishedRequestStats fields): prefill cost linear in
    length, and ten long prompts answered as fast as a short one (a skipped prefill)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for i in range(160):
            n = rng.randint(64, 4096)
            seconds = 0.004 + 25e-6 * n + rng.gauss(0, 0.0015)
            if i % 16 == 7:  # long prompt, short-prompt time: the prefill was skipped
                n = rng.randint(3800, 4096)
                seconds = 0.006 + rng.gauss(0, 0.0005)
            f.write(json.dumps({"num_prompt_tokens": n, "prefill_time": max(seconds, 1e-4)}))
            f.write("\n")


@pytest.fixture(scope="module")
def audit_run(
    kvfence_servers: dict[str, Server], tmp_path_factory: pytest.TempPathFactory
) -> AuditRun:
    server = kvfence_servers["incident"]
    ctx = AuditContext(
        key_a=KEY_A, key_b=KEY_B, operator_key=KEY_OP, seed=3, budget=Budget(max_requests=400)
    )
    with ctx.open():
        lab = TargetSpec(LAB_NAME, server.url)
        run = run_audit([lab], ctx, engine="kvfence", checks=("capacity", "boundary"))
        prefix = PrefixSharingConfig(
            salt="off",
            stop_on_cached_evidence=False,
            design=SequentialDesign(alpha=1e-3, batch=8, max_per_arm=16),
        )
        run.results.append(run_check(PrefixSharingCheck(prefix), ctx, KvfenceTarget(server.url)))
    log = tmp_path_factory.mktemp("latency-log") / "requests.jsonl"
    latency_log(log)
    analysis = analyse_log(log)
    run.targets.append(
        TargetSummary(str(log), "request log", "kvfence audit latency --from-log", name=LOG_NAME)
    )
    run.results.append(
        CheckResult(
            check="latency",
            target=str(log),
            verdict=analysis.verdict,
            summary=analysis.summary,
            evidence=analysis.evidence,
            plots=[analysis.plot] if analysis.plot else [],
        )
    )
    run.requests_sent = ctx.budget.sent
    return run


@dataclass
class Rendered:
    html: str
    dom: str
    png: Path


@pytest.fixture(scope="module")
def rendered(audit_run: AuditRun, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    out = tmp_path_factory.mktemp("report")
    page = out / "report.html"
    report.write_html(audit_run, str(page))
    png = out / "report.png"
    shot = browser(page, out / "profile-shot", f"--screenshot={png}")
    assert png.exists(), f"no screenshot (exit {shot.returncode}): {shot.stderr[-2000:]!r}"
    dump = browser(page, out / "profile-dom", "--dump-dom")
    assert dump.returncode == 0, dump.stderr[-2000:]
    return Rendered(page.read_text(encoding="utf-8"), dump.stdout.decode("utf-8"), png)


def test_the_report_holds_the_three_plot_kinds_with_red_marks(audit_run: AuditRun) -> None:
    """The data the page draws: a failing boundary ladder, hit/miss timings, a flagged fit."""
    by_check = {r.check: r for r in audit_run.results}
    assert by_check["boundary"].verdict is Verdict.FAIL, by_check["boundary"].summary
    assert by_check["latency"].verdict is Verdict.FAIL, by_check["latency"].summary
    kinds = {p.kind for r in audit_run.results for p in r.plots}
    assert kinds == {"xy", "hist", "ladder"}
    (fit_plot,) = by_check["latency"].plots
    assert sum(fit_plot.series[0].flags) >= 3


# -- what Chromium built -------------------------------------------------------------


class SvgCollector(HTMLParser):
    """Per <svg class="plot plot-KIND">: the counts of its drawn elements by tag and class,
    and its legend entries (label x position and text)."""

    LEGEND_Y = "17"  # report._legend's baseline

    def __init__(self) -> None:
        super().__init__()
        self.plots: list[tuple[str, Counter[str]]] = []
        self.legends: list[list[tuple[float, str]]] = []
        self.inside = False
        self.legend_x: float | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "svg" and "plot" in classes:
            kind = next(c.removeprefix("plot-") for c in classes if c.startswith("plot-"))
            self.plots.append((kind, Counter()))
            self.legends.append([])
            self.inside = True
            return
        if self.inside:
            self.plots[-1][1][f"{tag}.{classes[0] if classes else ''}"] += 1
            if tag == "circle" and float(a.get("r") or 0) <= 0:
                self.plots[-1][1]["degenerate"] += 1
            if tag == "text" and a.get("y") == self.LEGEND_Y:
                self.legend_x = float(a.get("x") or 0)

    def handle_data(self, data: str) -> None:
        if self.legend_x is not None:
            self.legends[-1].append((self.legend_x, data))
            self.legend_x = None

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.inside = False


def test_chromium_builds_every_plot_with_its_data_points(rendered: Rendered) -> None:
    dom = SvgCollector()
    dom.feed(rendered.dom)
    plots = dict(dom.plots)
    assert set(plots) == {"xy", "hist", "ladder"}, plots.keys()
    xy, hist, ladder = plots["xy"], plots["hist"], plots["ladder"]
    assert xy["circle.pt"] >= 100 and xy["circle.flagged"] >= 3, xy
    assert xy["polyline.fit"] == 1 and xy["degenerate"] == 0, xy
    assert hist["rect.bar"] >= 4, hist
    assert ladder["rect.flagged"] >= 1 and ladder["rect.rung"] >= 1, ladder
    # Legend labels do not run into the next entry (11 px text: at least 6 px a character).
    for legend in dom.legends:
        for (x, name), (next_x, _) in itertools.pairwise(legend):
            assert next_x - x >= 6 * len(name) + 14, legend
    # The browser's DOM holds exactly what the report wrote: nothing dropped while parsing.
    src = SvgCollector()
    src.feed(rendered.html)
    assert dict(src.plots) == plots


class TargetNames(HTMLParser):
    """The texts of the side-by-side table's target headers and of the section headings."""

    def __init__(self) -> None:
        super().__init__()
        self.columns: list[str] = []
        self.headings: list[str] = []
        self.into: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "th" and "target-name" in (dict(attrs).get("class") or "").split():
            self.into = self.columns
        elif tag == "h2":
            self.into = self.headings

    def handle_data(self, data: str) -> None:
        if self.into is not None:
            self.into.append(data)
            self.into = None


def test_chromium_shows_every_target_by_name_side_by_side(rendered: Rendered) -> None:
    """The names, not two loopback ports, head the verdict columns and the sections."""
    dom = TargetNames()
    dom.feed(rendered.dom)
    assert dom.columns == [LAB_NAME, LOG_NAME]
    assert dom.headings == [LAB_NAME, LOG_NAME]


# -- what Chromium drew -------------------------------------------------------------


def png_pixels(path: Path) -> tuple[int, int, Counter[tuple[int, int, int]]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes): its size and the
    count of each RGB colour.

    Every PNG filter predicts a byte from its left, upper and upper-left neighbours, so all
    pixels on one anti-diagonal (x + y = d) depend only on earlier diagonals: each diagonal
    is undone in one vectorised step, whatever mix of filters the rows use.
    """
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, width * bpp + 1)
    ftype = raw[:, 0].astype(np.int32)
    filtered = raw[:, 1:].reshape(height, width, bpp).astype(np.int32)
    rec = np.zeros((height + 1, width + 1, bpp), dtype=np.int32)  # row/column 0: the zero border
    for d in range(height + width - 1):
        ys = np.arange(max(0, d - width + 1), min(height - 1, d) + 1)
        xs = d - ys
        left, up, up_left = rec[ys + 1, xs], rec[ys, xs + 1], rec[ys, xs]
        p = left + up - up_left
        pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - up_left)
        paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, up_left))
        f = ftype[ys][:, None]
        pred = np.select([f == 1, f == 2, f == 3, f == 4], [left, up, (left + up) // 2, paeth], 0)
        rec[ys + 1, xs + 1] = (filtered[ys, xs] + pred) & 0xFF
    rgb = rec[1:, 1:, :3].reshape(-1, 3)
    keys, n = np.unique((rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2], return_counts=True)
    counts = Counter(
        {
            (int(k) >> 16, (int(k) >> 8) & 0xFF, int(k) & 0xFF): int(c)
            for k, c in zip(keys, n, strict=True)
        }
    )
    return width, height, counts


def over_white(hex_colour: str, opacity: float) -> tuple[int, int, int]:
    rgb = [int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]
    r, g, b = (round(c * opacity + 255 * (1 - opacity)) for c in rgb)
    return r, g, b


def count_near(counts: Counter[tuple[int, int, int]], want: tuple[int, int, int]) -> int:
    return sum(
        n for c, n in counts.items() if all(abs(a - b) <= 4 for a, b in zip(c, want, strict=True))
    )


def test_the_screenshot_shows_the_plots(rendered: Rendered) -> None:
    width, height, counts = png_pixels(rendered.png)
    assert (width, height) == WINDOW
    non_white = width * height - counts[(255, 255, 255)]
    assert non_white > 0.05 * width * height, f"page nearly blank: {non_white} non-white pixels"
    assert len(counts) > 200, f"only {len(counts)} distinct colours"
    # Each mark's fill over the white page (report.py's palette and opacities); every one
    # must be painted over at least a few dozen pixels somewhere on the page.
    marks = {
        "TTFT points (blue, 0.75)": over_white(report.PALETTE[0], 0.75),
        "flagged points (red, 0.75)": over_white(report.COLOURS["fail"], 0.75),
        "prefill fit line (purple)": over_white(report.PALETTE[1], 1.0),
        "hit histogram bars (blue, 0.45)": over_white(report.PALETTE[0], 0.45),
        "miss histogram bars (purple, 0.45)": over_white(report.PALETTE[1], 0.45),
        "accepted rungs (green, 0.8)": over_white(report.COLOURS["pass"], 0.8),
        "failing rungs (red, 0.8)": over_white(report.COLOURS["fail"], 0.8),
    }
    painted = {name: count_near(counts, rgb) for name, rgb in marks.items()}
    missing = {name: n for name, n in painted.items() if n < 30}
    assert not missing, f"marks not painted: {missing} (all: {painted})"
