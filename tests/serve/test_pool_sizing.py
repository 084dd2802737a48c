"""Pools sized from the available memory (no sizing flags), printed, verified by the gate (I4)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfence.cli import main
from kvfence.engine.sizing import GateReport
from kvfence.kv.geometry import KVGeometry
from kvfence.serve.pool_sizing import (
    DEFAULT_KV_BYTES,
    PoolSizes,
    available_memory_bytes,
    gate_fix_hint,
)

SMOLLM = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16)  # 46,080 B/token
GIB = 1 << 30


def test_default_pool_holds_two_contexts_with_headroom_when_memory_allows() -> None:
    role = PoolSizes().plan("decode", SMOLLM, 8192, 1.25, available=16 * GIB)
    assert role.pages * SMOLLM.page_size == 2 * 10_240  # 2 x 8,192 x 1.25 tokens
    assert GateReport(role.pages * 16, 8192, 1.25).passed
    assert "sized from memory" in role.how and "--kv-bytes" in role.how


def test_default_pool_is_capped_by_the_fraction_and_says_so() -> None:
    role = PoolSizes(memory_fraction=0.1).plan("prefill", SMOLLM, 8192, available=2 * GIB)
    assert role.pages * SMOLLM.bytes_per_page <= 0.1 * 2 * GIB
    assert role.pages == int(0.1 * 2 * GIB) // SMOLLM.bytes_per_page
    assert "capped at 10% of 2.0 GiB available" in role.how


def test_small_models_keep_the_64_mib_floor_and_explicit_sizes_win() -> None:
    tiny = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32)
    assert PoolSizes().plan("decode", tiny, 4096, available=16 * GIB).pages == (
        DEFAULT_KV_BYTES // tiny.bytes_per_page
    )
    assert PoolSizes(decode_pages=7).plan("decode", tiny, 4096, available=1).pages == 7
    with pytest.raises(ValueError, match="fraction"):
        PoolSizes(memory_fraction=0.0)


def test_available_memory_is_measured() -> None:
    available = available_memory_bytes()
    assert available is not None and available > 0


def test_gate_fix_hint_names_the_flags_with_numbers_that_pass() -> None:
    report = GateReport(1456, 8192, 1.25)
    hint = gate_fix_hint(report, SMOLLM)
    assert "--kv-pages 640" in hint  # 10,240 tokens / 16
    assert f"--kv-bytes {640 * SMOLLM.bytes_per_page}" in hint
    assert "--kv-memory-fraction" in hint and "--context-length 1164" in hint
    assert GateReport(640 * 16, 8192, 1.25).passed and GateReport(1456, 1164, 1.25).passed


def test_serve_with_too_small_a_fraction_fails_the_gate_and_names_the_flags(
    checkpoint: Path,
) -> None:
    result = CliRunner().invoke(
        main, ["serve", "--model", str(checkpoint), "--kv-memory-fraction", "0.0000001"]
    )
    assert result.exit_code == 1, result.output
    assert "sized from memory" in result.stderr and "capped at" in result.stderr
    assert "capacity gate FAIL" in result.stderr
    assert "--kv-pages 320" in result.stderr  # 4,096 x 1.25 / 16
