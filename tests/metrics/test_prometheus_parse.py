"""The audit reads Prometheus text with prometheus_client's parser: label values unescaped."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfence.audit.targets.base import Sample, parse_prometheus

FIXTURES = Path(__file__).resolve().parents[1] / "audit" / "fixtures"

ESCAPED = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{note="say \\"hi\\"",path="C:\\\\kv",lines="a\\nb"} 1.0\n'
)


def test_escaped_label_values_come_out_unescaped() -> None:
    [sample] = parse_prometheus(ESCAPED)
    assert sample == Sample(
        "vllm:cache_config_info", {"note": 'say "hi"', "path": "C:\\kv", "lines": "a\nb"}, 1.0
    )


def test_a_line_it_cannot_read_costs_only_that_line() -> None:
    text = ESCAPED + "not a sample at all\n" + 'kvfence_requests_total{outcome="finished"} 3\n'
    samples = parse_prometheus(text)
    assert [(s.name, s.value) for s in samples] == [
        ("vllm:cache_config_info", 1.0),
        ("kvfence_requests_total", 3.0),
    ]
    assert samples[0].labels["path"] == "C:\\kv"


@pytest.mark.parametrize(
    "fixture",
    sorted(p.relative_to(FIXTURES).as_posix() for p in FIXTURES.rglob("*metrics*.txt")),
)
def test_every_engine_fixture_parses_whole(fixture: str) -> None:
    # The peers' recorded /metrics: every sample line comes back, none dropped as unreadable.
    text = (FIXTURES / fixture).read_text()
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("#")]
    assert len(parse_prometheus(text)) == len(lines) > 0
