"""The engine metrics under vLLM's and SGLang's meanings: real values from the engine.

The server is real (HTTP on loopback, the real pipeline and pools); the test
holds one request at each stage by stepping the engine itself and reads
/metrics over HTTP at each: waiting before its first token, running while it
decodes, the KV pool in use while its pages are resident, and every gauge back
to 0 once it has ended, though the prefix cache still keeps its prompt's pages.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable

import httpx
from metrics_helpers import Stepped

PROMPT = [5] * 300  # 18 full pages of 16 tokens: the prefix cache keeps them after the request
MAX_TOKENS = 8


def _value(m: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in m, f"{name}{labels} not exposed; have {sorted({k[0] for k in m})}"
    return m[key]


def _stream(s: Stepped, out: queue.Queue[str]) -> threading.Thread:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    def run() -> None:
        with httpx.stream("POST", s.url + "/v1/completions", headers=s.headers(), json=body,
                          timeout=120) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.put(line[len("data: ") :])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _until(what: str, done: Callable[[], bool], step: Callable[[], object], limit: int) -> None:
    """Call `step` until `done`; `limit` bounds a hung engine, not a timing."""
    for _ in range(limit):
        if done():
            return
        step()
        time.sleep(0.001)  # lets the server's loop deliver what the step produced
    raise AssertionError(f"gave up waiting for {what} after {limit} steps")


def test_running_waiting_and_kv_usage_follow_one_request(stepped: Stepped) -> None:
    s, model = stepped, stepped.model
    pipeline = s.parts.pipeline
    m = s.metrics()
    for name in ("kvfence_num_requests_running", "kvfence_num_requests_waiting"):
        assert _value(m, name, model_name=model) == 0
    for role in ("prefill", "decode"):
        assert _value(m, "kvfence_kv_cache_usage_perc", model_name=model, role=role) == 0

    events: queue.Queue[str] = queue.Queue()
    client = _stream(s, events)
    # Submitted, the engine not stepped: waiting, nothing reserved yet.
    _until("the request to be waiting",
           lambda: _value(s.metrics(), "kvfence_num_requests_waiting", model_name=model) == 1,
           lambda: time.sleep(0.05), 2000)  # fmt: skip
    m = s.metrics()
    assert _value(m, "kvfence_num_requests_running", model_name=model) == 0

    # Step until its first token reached the client: running, its prompt's pages resident.
    _until("the first token at the client", lambda: not events.empty(), pipeline.pump, 2000)
    m = s.metrics()
    assert _value(m, "kvfence_num_requests_running", model_name=model) == 1
    assert _value(m, "kvfence_num_requests_waiting", model_name=model) == 0
    decode = next(p for p in pipeline.stats().pools if p.role == "decode")
    resident = decode.pages_used + decode.pages_pending
    assert resident >= len(PROMPT) // 16  # the decode reservation holds the whole prompt
    usage = _value(m, "kvfence_kv_cache_usage_perc", model_name=model, role="decode")
    assert usage == resident / 64 and 0 < usage <= 1

    # Step to the end: every gauge back to 0.
    _until("the request to end", lambda: not client.is_alive(), pipeline.pump, 5000)
    client.join()
    m = s.metrics()
    assert _value(m, "kvfence_num_requests_running", model_name=model) == 0
    assert _value(m, "kvfence_num_requests_waiting", model_name=model) == 0
    prefill = next(p for p in pipeline.stats().pools if p.role == "prefill")
    assert prefill.pages_used >= len(PROMPT) // 16  # the prefix cache keeps the prompt ...
    for role in ("prefill", "decode"):  # ... and gives it back on demand: not in use
        assert _value(m, "kvfence_kv_cache_usage_perc", model_name=model, role=role) == 0

    # One finished request: one end-to-end latency, one gap between each two of its tokens.
    chunks = [json.loads(e) for e in list(events.queue) if e != "[DONE]"]
    tokens = chunks[-1]["usage"]["completion_tokens"]
    assert tokens == MAX_TOKENS
    assert _value(m, "kvfence_e2e_request_latency_seconds_count", model_name=model) == 1
    assert _value(m, "kvfence_e2e_request_latency_seconds_sum", model_name=model) > 0
    # The engine sends one token per step here (the first from prefill, then one per decode step).
    itl = _value(m, "kvfence_inter_token_latency_seconds_count", model_name=model)
    assert itl == MAX_TOKENS - 1
