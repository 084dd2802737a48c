"""Defence in depth, through real HTTP: the incident leaks only with all four defences off."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfence.cli import main
from kvfence.faults import Fault
from kvfence.lab.matrix import MatrixRow, run_matrix
from kvfence.lab.scenario import Outcome


@pytest.fixture(scope="module")
def rows(lab_checkpoint: Path) -> list[MatrixRow]:
    """All 16 rows, run once: each is its own fresh server and holds no state the tests change,
    so the claims below read the same rows (the CLI's own run is the third test's)."""
    return run_matrix(lab_checkpoint, seed=3)


def test_leak_only_with_every_defence_off(rows: list[MatrixRow]) -> None:
    assert len(rows) == 16
    by_defences = {row.defences_on: row for row in rows}
    incident = by_defences[frozenset()]
    # The Workers AI symptom: HTTP 200, a prompt_tokens count matching B's own request, A's data in the body.
    assert incident.result.outcome is Outcome.LEAK
    assert incident.result.b.status == 200
    assert incident.result.b.reported_prompt_tokens == incident.result.b.prompt_tokens
    assert incident.result.sentinel in incident.result.b.text
    for row in rows:
        if row.defences_on:
            assert row.result.outcome is Outcome.CLEAN_ERROR, (
                sorted(f.value for f in row.defences_on),
                row.result.b,
            )
            assert row.result.leaked_fragment is None
            assert row.result.b.status >= 400 and row.result.b.body["error"]["message"]


def test_each_single_defence_names_its_own_error(rows: list[MatrixRow]) -> None:
    """Which defence stopped it is visible in the error the client receives."""
    singles = {r.defences_on: r for r in rows if len(r.defences_on) == 1}
    assert len(singles) == 4
    msg = {next(iter(k)): r.result.b.body["error"]["message"] for k, r in singles.items()}
    assert "max_req_input_len" in msg[Fault.UNDERSIZED_POOL]  # I4: the edge limit
    assert (
        "prefill pool holds at most" in msg[Fault.ABORT_NOT_TERMINAL]
    )  # I2: the original reject error
    assert "num_tokens" in msg[Fault.DECODE_TRUSTS_BOOTSTRAP]  # I3: manifest vs reservation
    assert "isolation violation" in msg[Fault.NO_LEDGER_CHECK]  # I1: the ledger check


def test_matrix_command_exit_code(lab_checkpoint: Path) -> None:
    result = CliRunner().invoke(main, ["lab", "matrix", "--checkpoint", str(lab_checkpoint)])
    assert result.exit_code == 0, result.output
    assert "defence in depth holds" in result.output
    assert result.output.count("-> clean error") == 15 and result.output.count("-> leak") == 1
