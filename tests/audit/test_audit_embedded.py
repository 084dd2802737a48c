"""`kvfence audit` with no target: the incident lab and the hardened engine side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfence.cli import main

pytestmark = pytest.mark.slow


def test_embedded_demo_is_red_on_the_lab_and_green_on_the_fix(tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    res = CliRunner().invoke(
        main,
        ["audit", "--checks", "capacity,boundary,counters", "--quiet", "--json", str(out)],
        catch_exceptions=False,
    )
    assert res.exit_code == 1, res.output
    assert "HTML report: " in res.output  # written to a printed path even without --report
    html_path = res.output.split("HTML report: ")[1].split()[0]
    assert Path(html_path).read_text().startswith("<!doctype html>")
    rep = json.loads(out.read_text())
    lab, hardened = (t["url"] for t in rep["targets"])
    verdicts = {(r["target"], r["check"]): r["verdict"] for r in rep["results"]}
    assert verdicts[(lab, "capacity")] == "fail"
    assert verdicts[(lab, "boundary")] == "fail"
    assert verdicts[(hardened, "capacity")] == "pass"
    assert verdicts[(hardened, "boundary")] == "pass"
    assert verdicts[(hardened, "counters")] == "pass"
