"""The counters check on a vLLM prefill node whose transfer leases ran out (captured live).

The fixture is prefill's `/metrics` from the lease test's fleet (tests/peers), after
decode read blocks whose lease had expired: `vllm:nixl_num_kv_expired_reqs` 8 and
`vllm:nixl_num_notifications_after_expiry` 6. The same text with both at 0 stands for
the snapshot taken before the audit. A move must come with what the counter means.
"""

from __future__ import annotations

import re

from audit_replay import FIXTURES, ReplayServer, Route

from kvfence.audit.base import Verdict
from kvfence.audit.checks.counters.check import CountersCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.vllm import VllmTarget

EXPIRED = FIXTURES / "vllm" / "0.32.0-nixl-prefill-expired.metrics.txt"


def _metrics(replay: ReplayServer, text: str) -> None:
    replay.routes[("GET", "/metrics")] = Route(200, text, "text/plain")


def test_late_reads_fail_the_counters_check_saying_what_they_mean(replay: ReplayServer) -> None:
    after = EXPIRED.read_text()
    before = re.sub(
        r"(vllm:nixl_num_(kv_expired_reqs|notifications_after_expiry)_total\{[^}]*\}) \d+\.0",
        r"\1 0.0",
        after,
    )
    assert before != after
    ctx = AuditContext()
    check = CountersCheck()
    target = VllmTarget(replay.url)
    with ctx.open():
        _metrics(replay, before)
        check.snapshot(ctx, target)
        _metrics(replay, after)
        res = run_check(check, ctx, target)
    assert res.verdict is Verdict.FAIL
    assert "vllm:nixl_num_kv_expired_reqs 0 → 8 (prefill (this node counts it) freed" in res.summary
    assert (
        "vllm:nixl_num_notifications_after_expiry 0 → 6 (decode finished reading blocks whose "
        "lease had already run out" in res.summary
    )
    assert "vllm:nixl_num_failed_transfers" not in res.summary  # unmoved: named only in rows
