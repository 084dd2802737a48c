"""The transfer-reference check on kvfence's own PD hub (`serve --disaggregated --router kvfence`).

The hub makes every room itself and its workers speak only to it (ZeroMQ, no HTTP), so the
only route is its public URL, where both engines' transfer fields are fields kvfence does not
take: vLLM's `kv_transfer_params` hands tenant A no reference, and SGLang's bootstrap room is
refused with a 400 that names it. The check passes on the refusal (a real probe, not
"nothing to test").
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from audit_servers import KEY_A, KEY_B, KEY_OP, LARGE, Server, start, stop, wait_ready

from kvfence.audit.base import Budget, Verdict
from kvfence.audit.checks.transfer_reference.check import TransferReferenceCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.registry import detect

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tr-hub")
    server = start(tmp, "hub", pages=LARGE, extra=("--disaggregated", "--router", "kvfence"))
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


def test_the_check_passes_on_the_hub_by_refusing_the_fields(hub: Server) -> None:
    ctx = AuditContext(
        key_a=KEY_A, key_b=KEY_B, operator_key=KEY_OP, budget=Budget(200, 300), seed=0
    )
    with ctx.open():
        target = detect(hub.url, ctx.client_for_url(hub.url, "a"))
        res = run_check(TransferReferenceCheck(), ctx, target)
    assert res.verdict is Verdict.PASS, res.summary
    assert res.evidence["reference_from"] is None and res.evidence["asked"], res.evidence
    assert "no route handed tenant A a `kv_transfer_params` reference" in res.summary
    rows = res.evidence["outcomes"]
    assert isinstance(rows, list) and [r["case"] for r in rows] == ["bootstrap-live"], rows
    (public,) = rows
    assert public["route"] == f"public {hub.url}" and public["status"] == 400, public
    assert "bootstrap_" in public["detail"], public  # the refusal names the field
