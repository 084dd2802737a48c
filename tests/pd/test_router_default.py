"""`--disaggregated` starts sglang-router unless `--router kvfence`; options only the hub
honours are refused up front (exit 2, naming the fix), never dropped silently."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from click.testing import CliRunner

from kvfence.cli import main
from kvfence.serve.pd.cli import router_of

BASE = ["serve", "--disaggregated", "--model", "/nonexistent/m"]


@pytest.mark.parametrize(
    ("given", "disaggregated", "expected"),
    [(None, True, "sglang"), (None, False, "kvfence"), ("kvfence", True, "kvfence")],
)
def test_the_default_router(given: str | None, disaggregated: bool, expected: str) -> None:
    assert router_of({"pd_router": given, "disaggregated": disaggregated}) == expected


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--no-auth"], "--no-auth"), (["--request-log", "/tmp/kvf-unused.log"], "--request-log")],
)
def test_hub_only_options_are_refused_on_the_real_stack(extra: list[str], named: str) -> None:
    result = CliRunner().invoke(main, [*BASE, *extra])
    assert result.exit_code == 2, result.output
    assert f"not with sglang-router: {named}" in result.output
    assert "--router kvfence" in result.output


def test_a_missing_sglang_router_names_the_extra_and_the_hub(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "sglang_router" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    result = CliRunner().invoke(main, BASE)
    assert result.exit_code == 2, result.output
    assert "sglang-router is not installed (pip install 'kvfence[pd]')" in result.output
    assert "--router kvfence" in result.output
