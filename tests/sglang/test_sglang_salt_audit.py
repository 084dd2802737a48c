"""`kvfence audit` through the real sglang-router 0.3.2: the router drops `cache_salt` on chat.

Tenants stay apart by key, so only tenant A's own salts can show it: on
`/v1/chat/completions` a different salt hits A's cached prefix (FAIL, the
router named as the likely cause); on `/v1/completions`, where the router
keeps the salt, the same probe passes (no false alarm). One stack with the
prefix cache on (~4 s to start).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sgl_helpers import OPERATOR_KEY, Fleet, fleet

from kvfence.audit.base import Budget, Verdict
from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.routers import SglangRouterTarget

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cached(sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(
        sgl_checkpoint,
        tmp_path_factory.mktemp("salt"),
        prefix_cache=True,
        keyed_control_plane=False,
    ) as f:
        yield f


def _audit(f: Fleet, out: Path) -> dict[str, Any]:
    """`kvfence audit --checks prefix_sharing` in-process through the router: its result."""
    from click.testing import CliRunner

    from kvfence.cli import main

    args = [
        "audit",
        "--target",
        f.operator_url,
        "--key-a",
        f.keys["tenant-a"],
        "--key-b",
        f.keys["tenant-b"],
    ]
    args += ["--operator-key", OPERATOR_KEY, "--checks", "prefix_sharing", "--quiet"]
    CliRunner().invoke(main, [*args, "--json", str(out)], catch_exceptions=False)
    rep = json.loads(out.read_text())
    return dict(next(r for r in rep["results"] if r["check"] == "prefix_sharing"))


def test_the_audit_through_the_router_finds_the_salt_dropped_on_chat(
    cached: Fleet, tmp_path: Path
) -> None:
    result = _audit(cached, tmp_path / "r.json")
    ev = result["evidence"]
    assert result["verdict"] == "fail", result["summary"]
    chat, completions = ev["salt_within_tenant"]["chat"], ev["salt_within_tenant"]["completions"]
    assert chat["verdict"] == "fail" and completions["verdict"] == "pass", result["summary"]
    assert "same salt hits, different salt also hits" in chat["summary"]
    assert chat["different_salt"]["hit_by_cached_tokens"], chat
    assert "sglang-router" in chat["likely_cause"] and "chat" in chat["likely_cause"], chat
    assert "likely_cause" not in completions
    # Across tenants the salt never mattered: keys keep A and B apart (I8).
    assert ev["unsalted"]["verdict"] == ev["salted"]["verdict"] == "pass", result["summary"]
    assert "/r/" not in json.dumps(ev), "a worker's router credential leaked into the evidence"


def test_an_audit_that_salts_completions_only_does_not_false_alarm(cached: Fleet) -> None:
    """A deployment that sends its salts on /v1/completions only (the README's way around)."""
    cfg = PrefixSharingConfig(salt="only", salt_routes=("completions",))
    ctx = AuditContext(
        key_a=cached.keys["tenant-a"],
        key_b=cached.keys["tenant-b"],
        operator_key=OPERATOR_KEY,
        seed=3,
        budget=Budget(max_requests=2000, max_seconds=300),
    )
    with ctx.open():
        target = SglangRouterTarget(cached.operator_url)
        result = run_check(PrefixSharingCheck(cfg), ctx, target)
    assert result.verdict is Verdict.PASS, result.summary
    routes = result.evidence["salt_within_tenant"]
    assert isinstance(routes, dict) and list(routes) == ["completions"]
