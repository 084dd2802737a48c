"""The Grafana dashboard: engine panels per scrape target, guard panels per guarded target."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from metrics_helpers import Stepped

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvfence-guard.json"
# A metric name and the selector right after it, if any.
SERIES = re.compile(r"\b(kvfence_[a-z0-9_]+)(\{[^}]*\})?")
CONVENTIONS = (
    "kvfence_num_requests_running",
    "kvfence_num_requests_waiting",
    "kvfence_kv_cache_usage_perc",
    "kvfence_e2e_request_latency_seconds",
    "kvfence_inter_token_latency_seconds",
)


def _exprs(dash: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def _family(series: str) -> str:
    return re.sub(r"_(bucket|total|count|sum)$", "", series)


def _variables(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def test_every_query_filters_by_its_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = _variables(dash)
    for name, metric in (("instance", "kvfence_context_length"), ("target", "kvfence_guard_")):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], v
        assert metric in v["definition"] and v["definition"].endswith(f", {name})")
    unscoped = []
    for expr in _exprs(dash):
        for series, selector in SERIES.findall(expr):
            # The guard's series name their target in `target`; an engine's are per scrape.
            want = (
                'target=~"$target"'
                if series.startswith("kvfence_guard_")
                else ('instance=~"$instance"')
            )
            if want not in selector:
                unscoped.append(f"{series}{selector} in {expr}")
    assert unscoped == []


def test_the_engine_series_charted_are_the_ones_it_exports(stepped: Stepped) -> None:
    dash = json.loads(DASHBOARD.read_text())
    # Families as the engine declares them (a labelled histogram has no sample before its
    # first observation, but its # TYPE line is there).
    r = stepped.http.get(stepped.url + "/metrics", headers=stepped.headers("operator"))
    exported = {_family(n) for n in re.findall(r"^# TYPE (\S+) ", r.text, re.M)}
    charted = {
        _family(s)
        for e in _exprs(dash)
        for s, _ in SERIES.findall(e)
        if not s.startswith("kvfence_guard_")
    }
    assert charted - exported == set()
    variable = _variables(dash)["instance"]["definition"]
    assert re.search(r"label_values\((\w+),", variable).group(1) in exported  # type: ignore[union-attr]
    for name in CONVENTIONS:  # every ecosystem-convention metric has a panel
        assert any(name in e for e in _exprs(dash)), name
