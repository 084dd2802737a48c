"""`--disaggregated` starts sglang-router unless `--router kvfence`; options only the hub
honours are refused up front (exit 2, naming the fix), never dropped silently."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from click.testing import CliRunner

from kvfence.cli import main
from kvfence.launch.cli import serve
from kvfence.launch.options import PDRouter, ServeOptions

BASE = ["serve", "--disaggregated", "--model", "/nonexistent/m"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--disaggregated"], PDRouter.SGLANG),
        (
            ["--role", "prefill", "--inbox", "tcp://a:1", "--router-addr", "tcp://b:2"],
            PDRouter.KVFENCE,
        ),
        (["--disaggregated", "--router", "kvfence"], PDRouter.KVFENCE),
        ([], None),
    ],
)
def test_the_default_router(argv: list[str], expected: PDRouter | None) -> None:
    options = ServeOptions(**serve.make_context("serve", [*argv, "--model", "/m"]).params)
    assert options.pd_router is expected


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
