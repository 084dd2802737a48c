"""A paced client sends a 503 or an unanswered request again, within its pacing; what the
statistical checks count is the answer that came back in the end, never the failure.

The server here is a real HTTP server on loopback that answers like a router whose workers
are briefly out of its pool (vllm-router's 503 "No available workers") before it answers
like an OpenAI server: the condition cannot be produced on demand with the real router.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvfence.audit.base import CheckResult, Verdict
from kvfence.audit.budget import Budget
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, Check, run_check
from kvfence.audit.pacing import Pacing, RetryAllowance, unavailable_reason
from kvfence.audit.targets.base import Target
from kvfence.audit.targets.openai import OpenAITarget


class Flaky:
    """Answers the first `unavailable` POSTs with 503, then a one-token completion stream."""

    def __init__(self, unavailable: int, status: int = 503) -> None:
        self.unavailable, self.status = unavailable, status
        self.posts = 0
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with flaky.lock:
                    flaky.posts += 1
                    busy = flaky.posts <= flaky.unavailable
                if busy:
                    body = b'{"error": "No available workers"}'
                    self.send_response(flaky.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
                data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


@pytest.fixture
def serve() -> Iterator[Callable[[Flaky], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(flaky: Flaky) -> str:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), flaky.handler())
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


FAST = Pacing(retries=3, backoff_s=0.01, max_wait_s=30.0)


def test_a_503_is_sent_again_and_only_the_answer_counts(serve: Callable[[Flaky], str]) -> None:
    flaky = Flaky(unavailable=2)
    url = serve(flaky)
    budget = Budget(max_requests=10, max_seconds=60)
    client = ProbeClient(url, api_key=None, budget=budget, pacing=FAST)
    r = client.ttft([1, 2, 3])
    assert r.status == 200 and r.ttft_s is not None, r.outcome()
    assert [u.split(" after ")[0] for u in r.unavailable] == ["HTTP 503", "HTTP 503"]
    assert budget.sent == 3 and flaky.posts == 3  # every try is charged to the budget
    assert client.retry.to_json()["retried"] == 2
    assert r.brief()["unavailable_before"] == r.unavailable


def test_an_unpaced_client_reads_the_503_as_the_answer(serve: Callable[[Flaky], str]) -> None:
    """The checks that judge a 503 (a pool that ran out) get it as it came."""
    flaky = Flaky(unavailable=1)
    client = ProbeClient(serve(flaky), api_key=None, budget=Budget(10, 60))
    r = client.ttft([1, 2, 3])
    assert r.status == 503 and r.unavailable == [] and flaky.posts == 1


def test_a_target_that_stays_unavailable_comes_back_failed_after_the_stated_retries(
    serve: Callable[[Flaky], str],
) -> None:
    flaky = Flaky(unavailable=100)
    url = serve(flaky)
    client = ProbeClient(url, api_key=None, budget=Budget(100, 60), pacing=FAST)
    r = client.ttft([1, 2, 3])
    assert r.status == 503 and not r.ok  # a failure the check cannot count either way
    assert len(r.unavailable) == FAST.retries and flaky.posts == FAST.retries + 1


def test_other_server_errors_are_answers_not_retried(serve: Callable[[Flaky], str]) -> None:
    flaky = Flaky(unavailable=1, status=500)
    url = serve(flaky)
    client = ProbeClient(url, api_key=None, budget=Budget(10, 60), pacing=FAST)
    r = client.ttft([1, 2, 3])
    assert r.status == 500 and flaky.posts == 1


def test_the_wait_allowance_bounds_retries_over_the_whole_audit() -> None:
    allowance = RetryAllowance(Pacing(retries=5, backoff_s=4.0, max_wait_s=10.0))
    assert allowance.allows(0) and allowance.allows(1)  # 4 s, then 8 s: within 10 s
    allowance.spend(9.0)
    assert not allowance.allows(0)  # 9 + 4 > 10: the target is reported, not waited on
    assert not RetryAllowance(Pacing(retries=0)).allows(0)


def test_the_pause_stops_growing_and_the_default_outlasts_a_routers_recheck() -> None:
    pacing = Pacing(backoff_s=1.0, max_pause_s=16.0)
    assert [pacing.pause_s(i) for i in range(7)] == [1, 2, 4, 8, 16, 16, 16]
    # vllm-router takes an unhealthy worker back after two passing checks 60 s apart (its
    # defaults): one request of the default pacing waits that out, within one client's allowance.
    default = Pacing()
    riding_out = sum(default.pause_s(i) for i in range(default.retries))
    assert 120.0 <= riding_out <= default.max_wait_s, riding_out


def test_what_counts_as_unavailable() -> None:
    assert (
        unavailable_reason(None, "ReadTimeout: timed out")
        == "no HTTP answer: ReadTimeout: timed out"
    )
    assert unavailable_reason(503, None) == "HTTP 503"
    assert unavailable_reason(429, None) is None  # a tenant's rate limit is an answer
    assert unavailable_reason(400, None) is None


class _OneProbe(Check):
    """A statistical check's name and one timed probe through its paced client."""

    name = "latency"

    def run(self, ctx: AuditContext, target: Target) -> CheckResult:
        r = ctx.client(target, "b", paced=True).ttft([1, 2, 3])
        verdict = Verdict.PASS if r.ok else Verdict.INCONCLUSIVE
        return self.result(target, verdict, r.outcome())


def test_a_statistical_checks_evidence_says_what_was_retried(
    serve: Callable[[Flaky], str],
) -> None:
    flaky = Flaky(unavailable=2)
    url = serve(flaky)
    ctx = AuditContext(budget=Budget(10, 60), pacing=FAST)
    with ctx.open():
        res = run_check(_OneProbe(), ctx, OpenAITarget(url))
    assert res.verdict is Verdict.PASS, res.summary
    assert res.evidence["pacing"]["retried"] == 2, res.evidence
    assert res.requests_sent == 3
