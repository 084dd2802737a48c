"""`kvfence gate` and bare `kvfence`: the verdict is the exit code (I4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfence import __version__
from kvfence.cli import main


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_gate_fails_with_exit_1_on_the_incident_numbers() -> None:
    code, out, err = run("gate", "--pool-tokens", "681280", "--context", "1048576")
    assert code == 1
    assert "capacity gate FAIL" in err
    assert "681,280" in err and "1,048,576" in err and "short by 629,440" in err
    assert "PASS" not in out


def test_gate_passes_with_exit_0_on_the_fixed_pool() -> None:
    code, out, _ = run("gate", "--pool-tokens", "2040000", "--context", "1048576")
    assert code == 0
    assert "capacity gate PASS" in out and "margin 729,280 tokens" in out


def test_gate_headroom_option_changes_the_verdict() -> None:
    assert run("gate", "--pool-tokens", "1100000", "--context", "1048576")[0] == 1
    args = ("gate", "--pool-tokens", "1100000", "--context", "1048576", "--headroom", "1.0")
    assert run(*args)[0] == 0


def test_gate_computes_the_pool_from_geometry_and_budget() -> None:
    # Llama-3-8B-like KV in bf16: 131,072 bytes/token; 16 GiB -> 131,072 tokens.
    code, out, _ = run(
        "gate",
        "--layers", "32",
        "--kv-heads", "8",
        "--head-dim", "128",
        "--dtype", "bfloat16",
        "--kv-bytes", str(16 << 30),
        "--context", "131072",
    )  # fmt: skip
    assert code == 1  # exactly one context, no headroom
    assert "131,072 bytes/token" in out and "8,192 pages = 131,072 tokens" in out


def test_bad_input_is_a_usage_error_not_a_verdict() -> None:
    assert run("gate", "--layers", "0")[0] == 2
    assert run("gate", "--dtype", "int3")[0] == 2
    assert run("gate", "--kv-bytes", "-1")[0] == 2
    assert run("gate", "--pool-tokens", "10", "--headroom", "0.5")[0] == 2


@pytest.mark.slow
def test_bare_kvfence_is_the_main_job() -> None:
    """The README's main command: version, the gate report, then the embedded audit demo
    (the workers-ai-2026 lab red on the checks the incident breaks, the fix green), each
    target by its name, every failed check named."""
    code, out, _ = run()
    assert out.splitlines()[0] == f"kvfence {__version__}"
    assert "capacity gate PASS" in out and "bytes/token" in out
    lab_fails = "capacity, boundary, canary, noninterference, latency"
    assert f"incident lab (workers-ai-2026) fails: {lab_fails}" in out, out
    assert "hardened fails: nothing" in out, out
    assert code == 0 and "demo as expected" in out
    html = Path(out.split("HTML report: ")[-1].split()[0])
    assert html.read_text().startswith("<!doctype html>")


@pytest.mark.slow
def test_entry_point_exits_1_in_a_real_process() -> None:
    """The real process, as a deploy pipeline runs it: a failed gate blocks with exit 1."""
    exe = [sys.executable, "-c", "from kvfence.cli import main; main()"]
    bad = subprocess.run(
        [*exe, "gate", "--pool-tokens", "681280", "--context", "1048576"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1, bad.stderr
    assert "capacity gate FAIL" in bad.stderr and bad.stdout == ""
