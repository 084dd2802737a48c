"""The TGI adapter on each version's real `/info` (fixtures/tgi/README.md)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from audit_replay import ReplayServer

from kvfence.audit.base import Budget, Verdict
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.registry import detect
from kvfence.audit.targets.tgi import TgiTarget


@pytest.fixture
def client(replay: ReplayServer) -> Iterator[ProbeClient]:
    c = ProbeClient(replay.url, api_key=None, budget=Budget(max_requests=20))
    yield c
    c.close()


def capacity(url: str, headroom: float, context: int | None = None) -> Any:
    ctx = AuditContext(headroom=headroom, context_override=context)
    with ctx.open():
        return run_check(CapacityCheck(), ctx, TgiTarget(url))


@pytest.mark.parametrize("version", ["2.0.4", "2.2.0"])
def test_v2_reports_its_batch_pool_under_the_versions_field_names(
    version: str, replay: ReplayServer, client: ProbeClient
) -> None:
    replay.file("/info", f"tgi/{version}.info.json")
    target = detect(replay.url, client)
    assert target.engine == "tgi"
    facts = target.facts(client)
    assert facts.pool_tokens.value == 37872
    assert "batch budget" in facts.pool_tokens.note
    key = "max_input_length" if version == "2.0.4" else "max_input_tokens"
    assert facts.max_input.value == 1024 and key in facts.max_input.source
    assert facts.context_length.value == 2048
    assert "pool_guarantee_tokens" not in facts.extra
    assert capacity(replay.url, 1.25).verdict is Verdict.PASS
    assert capacity(replay.url, 1.25, context=31000).verdict is Verdict.FAIL


def test_v3_start_up_guarantee_decides_only_at_headroom_one(
    replay: ReplayServer, client: ProbeClient
) -> None:
    replay.file("/info", "tgi/3.3.7.info.json")
    facts = TgiTarget(replay.url).facts(client)
    assert not facts.pool_tokens.known
    assert facts.extra["pool_guarantee_tokens"].value == 8192
    assert facts.max_input.value == 8191
    at_one = capacity(replay.url, 1.0)
    assert at_one.verdict is Verdict.PASS
    assert "NotEnoughMemory" in at_one.evidence["pool_tokens"]["source"]
    over = capacity(replay.url, 1.25)
    assert over.verdict is Verdict.INCONCLUSIVE  # never a pass on a guarantee it does not give
    assert "guarantees" in over.summary
    # an operator context beyond the guaranteed request is not covered either, nor refuted:
    # the guarantee is a lower bound of the pool
    assert capacity(replay.url, 1.0, context=9000).verdict is Verdict.INCONCLUSIVE
