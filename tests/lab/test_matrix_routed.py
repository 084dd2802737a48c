"""The defence matrix on the incident's own topology: the real sglang-router, KV over Mooncake.

One stack (router + prefill + decode worker) per row, since the switches are
process options; each start is ~3 s here. The rows are the incident (every
switch on) and each defence alone, the ones that carry the claim.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvfence.cli import main
from kvfence.faults import Fault, FaultSet
from kvfence.lab.matrix import combinations, run_matrix
from kvfence.lab.routed import server_for
from kvfence.lab.scenario import Outcome

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _mooncake() -> None:
    pytest.importorskip("mooncake.engine")


def test_each_defence_alone_stops_the_incident_behind_the_real_router(
    lab_checkpoint: Path,
) -> None:
    rows = run_matrix(
        lab_checkpoint,
        seed=7,
        combos=combinations("singles"),
        server=server_for("sglang-router", "mooncake"),
    )
    by_defences = {row.defences_on: row for row in rows}
    assert len(by_defences) == 5
    incident = by_defences[frozenset()].result
    # Every switch on: the Workers AI symptom through the real router and Mooncake.
    assert incident.outcome is Outcome.LEAK, incident.b
    assert incident.b.status == 200 and incident.sentinel in incident.b.text
    assert incident.b.reported_prompt_tokens == incident.b.prompt_tokens
    assert incident.server_info["disaggregation_transfer_backend"] == "mooncake"
    msg = {}
    for defences, row in by_defences.items():
        if defences:
            assert row.result.outcome is Outcome.CLEAN_ERROR, (sorted(defences), row.result.b)
            msg[next(iter(defences))] = row.result.b.body["error"]["message"]
    # Which defence stopped it is named in the error the client receives through the router.
    assert "max_req_input_len" in msg[Fault.UNDERSIZED_POOL], msg  # I4: the edge limit
    assert "prefill pool holds at most" in msg[Fault.ABORT_NOT_TERMINAL], msg  # I2: prefill's error
    assert "num_tokens" in msg[Fault.DECODE_TRUSTS_BOOTSTRAP], msg  # I3: manifest vs reservation
    assert "isolation violation" in msg[Fault.NO_LEDGER_CHECK], msg  # I1: the ledger check


def test_a_switch_that_breaks_the_defence_turns_its_row_red(lab_checkpoint: Path) -> None:
    """The proof the rows above can fail: `abort-as-success` dresses I3's refusal up as a 200."""
    rows = run_matrix(
        lab_checkpoint,
        seed=7,
        combos=[frozenset({Fault.DECODE_TRUSTS_BOOTSTRAP})],  # I3 alone
        server=server_for("sglang-router", "mooncake"),
        also=FaultSet.of(Fault.ABORT_AS_SUCCESS),
    )
    (row,) = rows
    assert not row.as_expected
    assert row.result.outcome is Outcome.UNEXPECTED and row.result.b.status == 200, row.result.b


def test_matrix_command_refuses_an_unknown_switch() -> None:
    args = ["lab", "matrix", "--topology", "sglang-router", "--also-fault", "no-such-switch"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "no-such-switch" in result.output, result.output
