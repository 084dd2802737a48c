"""Noninterference against small real HTTP engines on loopback whose behaviour we choose.

An honest engine answers temperature-0 requests as a function of the prompt
only; an interfering one lets tenant A's in-flight traffic change tenant B's
answer (what a stale-page or cross-tenant read looks like from outside); a
noisy one is nondeterministic on its own. The check must pass, fail and stay
inconclusive respectively.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.noninterference.check import NoninterferenceCheck, NoninterferenceConfig
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.openai import OpenAITarget

KEY_A, KEY_B = "loop-key-a", "loop-key-b"


class Engine:
    """Shared state of the toy engine: which tenants have requests in flight."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.lock = threading.Lock()
        self.a_in_flight = 0
        self.rng = random.Random(0)

    def answer(self, prompt: Any, tenant: str) -> str:
        digest = hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:12]
        with self.lock:
            a_busy = self.a_in_flight > 0
            coin = self.rng.random()
        if tenant == "b" and self.mode == "interfering" and a_busy:
            return "stale:" + digest[:6]
        if self.mode == "noisy" and coin < 0.5:
            return "noise:" + digest[:6]
        return digest


def _handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def _send(self, status: int, obj: dict[str, Any]) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "toy", "object": "model"}]})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or body.get("logprobs") is not None:
                self._send(400, {"error": {"message": "logprobs not supported"}})
                return
            tenant = "a" if self.headers.get("Authorization") == f"Bearer {KEY_A}" else "b"
            if tenant == "a":
                with engine.lock:
                    engine.a_in_flight += 1
                time.sleep(0.02)  # A's requests take a while: B overlaps them
            try:
                text = engine.answer(body["prompt"], tenant)
            finally:
                if tenant == "a":
                    with engine.lock:
                        engine.a_in_flight -= 1
            self._send(
                200,
                {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1},
                },
            )

    return Handler


def _serve(mode: str) -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(Engine(mode)))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join()


@pytest.fixture(params=["honest", "interfering", "noisy"])
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    for url in _serve(request.param):
        yield request.param, url


def _check(url: str) -> CheckResult:
    ctx = AuditContext(key_a=KEY_A, key_b=KEY_B, seed=3, budget=Budget(1000, 120))
    cfg = NoninterferenceConfig(repeats=6, load_concurrency=3)
    with ctx.open():
        return run_check(NoninterferenceCheck(cfg), ctx, OpenAITarget(url))


EXPECTED = {
    "honest": Verdict.PASS,
    "interfering": Verdict.FAIL,
    "noisy": Verdict.INCONCLUSIVE,
}


def test_noninterference_verdicts(engine: tuple[str, str]) -> None:
    mode, url = engine
    res = _check(url)
    assert res.verdict is EXPECTED[mode], res.summary
    ev = res.evidence
    # The toy engine refuses logprobs: the check falls back to text comparison.
    assert ev["logprobs"] is False
    if mode == "honest":
        assert ev["baseline"]["diverged"] == 0 and ev["under_load"]["diverged"] == 0
        assert ev["load"]["ok"] > 0
    if mode == "interfering":
        assert ev["baseline"]["diverged"] == 0
        assert ev["under_load"]["diverged"] > 0
        assert ev["fisher_p_value"] < 1e-3
        assert ev["under_load"]["examples"][0]["got_text"].startswith("stale:")
    if mode == "noisy":
        assert ev["unstable_alone"]
