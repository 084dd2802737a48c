"""Pool sizing and the capacity gate (I4), with the incident's own numbers."""

from __future__ import annotations

import pytest

from kvfence.engine.sizing import (
    DEFAULT_HEADROOM,
    CapacityGateError,
    GateReport,
    MemoryBudget,
    capacity_gate,
    pool_from_budget,
)
from kvfence.kv.geometry import KVGeometry

INCIDENT_POOL = 681_280
CONTEXT = 1_048_576
FIXED_POOL = 2_040_000


def test_the_incident_pool_fails_the_gate_and_says_why() -> None:
    with pytest.raises(CapacityGateError) as info:
        capacity_gate(INCIDENT_POOL, CONTEXT)
    report = info.value.report
    assert not report.passed
    assert report.required_tokens == 1_310_720  # 1,048,576 x 1.25
    assert report.margin_tokens == -629_440
    text = str(info.value)
    assert "681,280" in text and "1,048,576" in text  # both numbers
    assert "short by 629,440 tokens" in text  # the shortfall
    assert "more memory" in text and "lower the context length to <= 545,024" in text  # fix 1
    assert "--allow-undersized-pool" in text and "HTTP 400" in text  # fix 2


def test_the_incident_pool_fails_even_without_headroom() -> None:
    with pytest.raises(CapacityGateError, match="short by 367,296 tokens"):
        capacity_gate(INCIDENT_POOL, CONTEXT, headroom=1.0)


def test_the_fixed_pool_passes_and_states_the_margin() -> None:
    decision = capacity_gate(FIXED_POOL, CONTEXT)
    assert decision.report.passed and not decision.undersized
    assert decision.edge_limit == CONTEXT
    assert decision.report.headroom == DEFAULT_HEADROOM == 1.25
    assert decision.report.margin_tokens == 729_280
    text = decision.report.message()
    assert text.startswith("capacity gate PASS")
    assert "2,040,000" in text and "1,048,576" in text and "margin 729,280 tokens" in text
    assert "pool/context = 1.945" in text


def test_gate_boundary_is_inclusive() -> None:
    assert capacity_gate(1_310_720, CONTEXT).report.margin_tokens == 0
    with pytest.raises(CapacityGateError, match="short by 1 tokens"):
        capacity_gate(1_310_719, CONTEXT)


def test_allow_undersized_returns_the_pool_as_edge_limit() -> None:
    decision = capacity_gate(INCIDENT_POOL, CONTEXT, allow_undersized=True)
    assert decision.undersized and not decision.report.passed
    assert decision.edge_limit == INCIDENT_POOL
    # A pool that holds one context but not the headroom: the edge limit is the context.
    roomy = capacity_gate(1_100_000, CONTEXT, allow_undersized=True)
    assert roomy.undersized and roomy.edge_limit == CONTEXT


@pytest.mark.parametrize(
    ("pool", "context", "headroom", "message"),
    [
        (-1, CONTEXT, 1.25, "pool_tokens"),
        (1, 0, 1.25, "context_length"),
        (1, CONTEXT, 0.9, "headroom"),
    ],
)
def test_gate_rejects_nonsense_inputs(
    pool: int, context: int, headroom: float, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        GateReport(pool, context, headroom)


def test_bytes_per_token_matches_the_formula() -> None:
    llama8b = KVGeometry(
        num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16"
    )
    assert llama8b.dtype_bytes == 2
    assert llama8b.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert llama8b.bytes_per_page == 131_072 * 16
    fp32 = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")
    assert fp32.bytes_per_token == 2 * 2 * 2 * 32 * 4
    assert (fp32.pages_for(0), fp32.pages_for(1), fp32.pages_for(16), fp32.pages_for(17)) == (
        0,
        1,
        1,
        2,
    )


def test_pool_from_budget_rounds_down_to_whole_pages() -> None:
    geom = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
    page = geom.bytes_per_page
    size = pool_from_budget(geom, MemoryBudget(kv_bytes=10 * page + page - 1))
    assert size.num_pages == 10 and size.tokens == 160
    assert size.bytes_per_token == geom.bytes_per_token
    assert size.bytes == 10 * page
    assert pool_from_budget(geom, MemoryBudget(kv_bytes=page - 1)).num_pages == 0


def test_pool_from_device_memory_minus_weights() -> None:
    geom = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
    gib = 1 << 30
    budget = MemoryBudget(device_bytes=80 * gib, weight_bytes=16 * gib, fraction=0.9)
    assert budget.kv_budget_bytes == int(80 * gib * 0.9) - 16 * gib
    size = pool_from_budget(geom, budget)
    assert size.num_pages == budget.kv_budget_bytes // (131_072 * 16)
    assert size.tokens % 16 == 0 and size.bytes <= budget.kv_budget_bytes
    # Weights larger than the usable memory leave an empty pool, which the gate then fails.
    starved = pool_from_budget(geom, MemoryBudget(device_bytes=gib, weight_bytes=2 * gib))
    assert starved.tokens == 0
    with pytest.raises(CapacityGateError):
        capacity_gate(starved.tokens, 4096)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one"),
        ({"kv_bytes": 1, "device_bytes": 1}, "exactly one"),
        ({"kv_bytes": 1, "fraction": 0.0}, "fraction"),
        ({"kv_bytes": -1}, "kv_bytes must be >= 0"),
        ({"device_bytes": 1, "weight_bytes": -5}, "weight_bytes must be >= 0"),
    ],
)
def test_memory_budget_validation(kwargs: dict[str, int | float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryBudget(**kwargs)  # type: ignore[arg-type]
