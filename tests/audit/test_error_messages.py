"""Errors that say what to do, against a real `kvfence serve` with a 382-token vocabulary.

The probes' default id range reaches 499; a server with a smaller vocabulary refused them
(400) and the audit came back INCONCLUSIVE, the reason only in the evidence. The audit now
reads the vocabulary the server states and draws ids inside it; a probe that fails shows
the engine's own words; a refused /metrics names --operator-key.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from audit_servers import KEY_A, KEY_B, KEY_OP, LARGE, Server, start, stop, wait_ready
from small_vocab import VOCAB, small_vocab_checkpoint

from kvfence.audit.base import Budget, Verdict
from kvfence.audit.checks.counters.check import CountersCheck
from kvfence.audit.checks.noninterference.check import NoninterferenceCheck
from kvfence.audit.checks.noninterference.probes import NoninterferenceConfig
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.kvfence import KvfenceTarget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# One short probe, no long one: what matters is whether B's first probe is accepted.
SMALL = NoninterferenceConfig(probes=1, probe_tokens=32, repeats=2, long_probe=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("small-vocab")
    model = small_vocab_checkpoint(tmp / "model")
    s = start(tmp, "small-vocab", pages=LARGE, extra=("--model", str(model)))
    try:
        wait_ready(s)
        yield s
    finally:
        stop(s)


def context(key_b: str = KEY_B, operator_key: str | None = KEY_OP) -> AuditContext:
    return AuditContext(
        key_a=KEY_A, key_b=key_b, operator_key=operator_key, budget=Budget(max_requests=3000)
    )


def test_the_vocabulary_is_read_from_what_the_server_states(server: Server) -> None:
    ctx = context()
    with ctx.open():
        target = KvfenceTarget(server.url)
        vocab = target.facts(ctx.client(target, "a")).vocab_size
    assert vocab.value == VOCAB, vocab
    assert "/openapi.json" in vocab.source


def test_probe_token_ids_stay_inside_a_382_token_vocabulary(server: Server) -> None:
    ctx = context()
    with ctx.open():
        target = KvfenceTarget(server.url)
        res = run_check(NoninterferenceCheck(SMALL), ctx, target)
    assert "failed alone" not in res.summary, res.summary
    assert res.verdict is Verdict.PASS, res.summary
    assert res.evidence["token_ids"]["range"] == [100, VOCAB]  # type: ignore[index,call-overload]


def test_a_probe_that_fails_shows_the_engines_own_error(server: Server) -> None:
    wrong = "not-a-key-of-this-server"
    said = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"Authorization": f"Bearer {wrong}"},
    ).json()["error"]["message"]
    ctx = context(key_b=wrong)
    with ctx.open():
        target = KvfenceTarget(server.url)
        res = run_check(NoninterferenceCheck(SMALL), ctx, target)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert f"B's probe failed alone (HTTP 401: {said})" in res.summary, res.summary


def test_metrics_refused_for_want_of_an_operator_key_names_the_option(server: Server) -> None:
    ctx = context(operator_key=None)
    with ctx.open():
        target = KvfenceTarget(server.url)
        check = CountersCheck()
        check.snapshot(ctx, target)
        res = run_check(check, ctx, target)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "GET /metrics answered 403" in res.summary, res.summary
    assert "pass --operator-key" in res.summary, res.summary
