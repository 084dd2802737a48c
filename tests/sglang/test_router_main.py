"""router_main: sglang-router's own arguments and router, without its launcher's imports."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

pytest.importorskip("sglang_router")

from kvfence.sglang_stack.router_main import ARGS_ON_STDIN, parse

PD = [
    "--pd-disaggregation",
    "--prefill", "http://127.0.0.1:9001/r/secret0123456789", "9002",
    "--decode", "http://127.0.0.1:9003/r/secret0123456789",
    "--host", "127.0.0.1", "--port", "9000", "--policy", "round_robin",
]  # fmt: skip


def test_arguments_parse_as_sglang_routers_own_launcher_parses_them() -> None:
    from sglang_router.launch_router import parse_router_args

    ours, theirs = parse(PD), parse_router_args(PD)
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)
    assert ours.pd_disaggregation and ours.prefill_urls == [(PD[2], 9002)]


def test_the_python_debugging_balancer_is_refused() -> None:
    with pytest.raises(SystemExit) as e:
        parse([*PD, "--mini-lb"])
    assert e.value.code == 2


def test_a_stack_that_stops_before_handing_the_arguments_ends_the_router() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence.sglang_stack.router_main", ARGS_ON_STDIN],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "stdin closed before the router's arguments came" in proc.stderr
