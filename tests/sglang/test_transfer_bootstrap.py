"""The transfer-reference check on kvfence's sglang-router stack: a client's bootstrap room.

Audited at the router's own listener (its `/workers` lists both workers with their router
credential paths and the prefill's bootstrap port), as the salt audit does. Tenant B names
the room of tenant A's live transfer, then the same room once A's next prompt holds it:

- hardened: the router overwrites a client's room (B's own answer at the public URL), the
  decode worker refuses a client's bootstrap fields off the router's path (400 naming the
  field), and on the router's path prefill refuses to pair halves of two tenants (409
  room_mismatch): the check passes;
- the lab's `decode-trusts-bootstrap`: decode takes the client's room and prefill pairs by
  room alone, so B is answered with A's continuation: the check fails naming the decode
  worker.

One stack each (~15 s to start on 2 cores).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sgl_helpers import OPERATOR_KEY, Fleet, fleet, wait_quiet

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.transfer_reference.check import TransferReferenceCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.routers import SglangRouterTarget
from kvfence.faults import Fault, FaultSet

pytestmark = pytest.mark.slow


def _audit(f: Fleet, seed: int = 0, url: str | None = None) -> CheckResult:
    """The check at the router's own listener (or at `url`)."""
    ctx = AuditContext(
        key_a=f.keys["tenant-a"],
        key_b=f.keys["tenant-b"],
        operator_key=OPERATOR_KEY,
        seed=seed,
        budget=Budget(max_requests=300, max_seconds=300),
    )
    with ctx.open():
        target = SglangRouterTarget(url or f.operator_url)
        return run_check(TransferReferenceCheck(), ctx, target)


def _rows(res: CheckResult, case: str) -> dict[str, dict[str, Any]]:
    rows = res.evidence["outcomes"]
    assert isinstance(rows, list)
    return {row["route"]: row for row in rows if row["case"] == case}


@pytest.fixture(scope="module")
def hardened(sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(sgl_checkpoint, tmp_path_factory.mktemp("tr-hard"), keyed_control_plane=False) as f:
        yield f


@pytest.fixture(scope="module")
def trusting(sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    faults = FaultSet.of(Fault.DECODE_TRUSTS_BOOTSTRAP)
    tmp = tmp_path_factory.mktemp("tr-trust")
    with fleet(sgl_checkpoint, tmp, faults=faults, keyed_control_plane=False) as f:
        yield f


def test_the_check_passes_on_the_hardened_stack(hardened: Fleet) -> None:
    res = _audit(hardened)
    assert res.verdict is Verdict.PASS, res.summary
    live = _rows(res, "bootstrap-live")
    decode = hardened.worker("decode").url
    public = live[f"public {hardened.operator_url}"]
    # sglang-router overwrites a client's room: B's answer is B's own, never A's.
    assert public["verdict"] == "own", public
    assert public["answer"] == public["own_continuations"]["B"] != public["own_continuations"]["A"]
    direct = live[f"decode {decode} (direct, without the router's credential)"]
    assert direct["status"] == 400 and "bootstrap_" in direct["detail"], direct
    routed = live[f"decode {decode} (the router's path)"]
    assert routed["status"] == 409 and "room" in routed["detail"], routed
    assert "/r/" not in json.dumps(res.evidence), "the router credential leaked into the evidence"
    facts = wait_quiet(hardened, "decode")
    assert (facts["pages_used"], facts["pages_pending"], facts["integrity"]) == (0, 0, "ok")


def test_the_tenants_address_refuses_a_clients_room(hardened: Fleet) -> None:
    """At the edge (the stack's public address) the fields never reach the router."""
    res = _audit(hardened, url=hardened.url)
    assert res.verdict is Verdict.PASS, res.summary
    rows = _rows(res, "bootstrap-live")
    public = rows[f"public {hardened.url}"]
    assert public["status"] == 400 and "bootstrap_" in public["detail"], public
    assert list(rows) == [f"public {hardened.url}"], rows  # the edge lists no workers


def test_the_check_fails_on_the_lab_switch_and_names_the_decode_worker(trusting: Fleet) -> None:
    res = _audit(trusting, seed=1)
    assert res.verdict is Verdict.FAIL, res.summary
    decode = trusting.worker("decode").url
    for case in ("bootstrap-live", "bootstrap-reused"):
        rows = _rows(res, case)
        for how in ("the router's path", "direct, without the router's credential"):
            row = rows[f"decode {decode} ({how})"]
            assert row["verdict"] == "leak" and row["status"] == 200, row
            theirs = next(k for k in row["own_continuations"] if k != "B")
            assert row["answer"] == row["own_continuations"][theirs], row
            assert row["answer"] != row["own_continuations"]["B"], row
    assert f"decode {decode} (direct" in res.summary  # the leaking route, by its origin
    # The router's overwrite still holds at the public URL under the switch.
    public = _rows(res, "bootstrap-live")[f"public {trusting.operator_url}"]
    assert public["verdict"] == "own", public
    assert "off the tenants' network" in str(res.evidence["advice"])
