"""The llama.cpp adapter on llama-server's own bytes (fixtures/llamacpp, captured live).

With `-np 2 -c 4096` `/props`, `/slots` and `/v1/models` all say `n_ctx` 2048, one slot's
share; with automatic slots four slots each say 4096 and share one pool of 4096. Either way
the figure is the most one request holds, never the pool, so it can fail the gate and never
pass it while more than one slot exists.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from audit_replay import ReplayServer

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.registry import detect

BUILD = "llamacpp/11434.0.0"


def serve(replay: ReplayServer, slots: str) -> None:
    for path, suffix in (("/props", "props.json"), ("/slots", "slots.json")):
        replay.file(path, f"{BUILD}-{slots}.{suffix}")
    replay.file("/v1/models", f"{BUILD}-{slots}.models.json")
    replay.file("/metrics", f"{BUILD}-{slots}.metrics.txt")


@pytest.fixture
def client(replay: ReplayServer) -> Iterator[ProbeClient]:
    c = ProbeClient(replay.url, api_key=None, budget=Budget(max_requests=50))
    yield c
    c.close()


def gate(url: str, headroom: float) -> CheckResult:
    ctx = AuditContext(headroom=headroom)
    with ctx.open():
        return run_check(CapacityCheck(), ctx, detect(url, ctx.client_for_url(url, "a")))


def test_explicit_slots_bound_the_pool_and_never_pass(
    replay: ReplayServer, client: ProbeClient
) -> None:
    serve(replay, "np2")
    facts = detect(replay.url, client).facts(client)
    assert facts.extra["total_slots"].value == 2
    assert facts.pool_tokens.value == 2048 and facts.context_length.value == 2048
    assert facts.max_input.value == 2047
    assert facts.counters["llamacpp:prompt_tokens_total"].value > 0  # the completion sent
    assert gate(replay.url, 1.25).verdict is Verdict.FAIL  # 2048 < 2048 x 1.25, even as a bound
    assert gate(replay.url, 1.0).verdict is Verdict.INCONCLUSIVE  # a bound never passes


def test_automatic_slots_claim_one_slot_of_the_shared_pool(
    replay: ReplayServer, client: ProbeClient
) -> None:
    serve(replay, "auto")
    facts = detect(replay.url, client).facts(client)
    assert facts.extra["total_slots"].value == 4
    assert facts.pool_tokens.value == 4096  # never 4 x 4096: the four share one pool
    assert "lower bound" in facts.pool_tokens.source
    assert facts.extra["version"].value == "b0-unknown"
    # no cache_prompt default in this build's /props: reuse is still any request's to ask for
    assert facts.prefix_caching.value is True
    assert facts.prefix_caching.source == "llama-server (cache_prompt)"
