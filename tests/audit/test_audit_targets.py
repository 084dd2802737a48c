"""Target adapters read the right numbers, with sources, from engine-shaped responses."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from audit_replay import ReplayServer, Route

from kvfence.audit.base import Budget, BudgetExhausted
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.registry import DetectionError, detect


@pytest.fixture
def client(replay: ReplayServer) -> Iterator[ProbeClient]:
    c = ProbeClient(replay.url, api_key="k", budget=Budget(max_requests=50))
    yield c
    c.close()


def test_llamacpp_claims_only_the_per_slot_lower_bound(
    replay: ReplayServer, client: ProbeClient
) -> None:
    replay.file("/props", "llamacpp/11434.0.0-auto.props.json")
    replay.file("/slots", "llamacpp/11434.0.0-auto.slots.json")
    replay.file("/v1/models", "llamacpp/11434.0.0-auto.models.json")
    replay.file("/metrics", "llamacpp/11434.0.0-auto.metrics.txt")
    target = detect(replay.url, client)
    assert target.engine == "llamacpp"
    facts = target.facts(client)
    assert facts.pool_tokens.value == 4096  # never 4 slots x 4096
    assert "lower bound" in facts.pool_tokens.source
    assert "share one pool" in facts.pool_tokens.note
    assert facts.extra["total_slots"].value == 4
    assert facts.max_input.value == 4095
    assert facts.cache_salt_supported.value is False
    assert not facts.page_size.known


def test_generic_openai_knows_no_capacity(replay: ReplayServer, client: ProbeClient) -> None:
    replay.json("/v1/models", {"object": "list", "data": [{"id": "m"}]})
    target = detect(replay.url, client)
    assert target.engine == "openai"
    facts = target.facts(client)
    assert not facts.pool_tokens.known
    assert facts.model.value == "m"


def test_detection_fails_on_a_non_llm_server(replay: ReplayServer, client: ProbeClient) -> None:
    with pytest.raises(DetectionError, match="no adapter recognised"):
        detect(replay.url, client)


def test_every_request_is_charged_to_the_budget(replay: ReplayServer) -> None:
    c = ProbeClient(replay.url, api_key=None, budget=Budget(max_requests=2))
    try:
        c.get("/a")
        c.get("/b")
        with pytest.raises(BudgetExhausted):
            c.get("/c")
    finally:
        c.close()
    assert len(replay.seen) == 2  # the third was never sent


def test_tokenize_falls_back_to_llamacpp_content_field(
    replay: ReplayServer, client: ProbeClient
) -> None:
    def tokenize(body: dict[str, object]) -> Route:
        # llama-server reads `content`; without it, it answers 200 with no tokens.
        text = body.get("content")
        ids = [ord(c) for c in text] if isinstance(text, str) else []
        return Route(200, json.dumps({"tokens": ids}))

    replay.handlers[("POST", "/tokenize")] = tokenize
    assert client.tokenize("abc") == [97, 98, 99]


def test_a_streamed_token_holding_a_unicode_line_separator_keeps_its_ttft(
    replay: ReplayServer, client: ProbeClient
) -> None:
    """JSON leaves U+0085 / U+2028 / U+2029 raw; str.splitlines (httpx's iter_lines) cut the
    event there, so the first chunk went unparsed and the TTFT unread (real vLLM, random ids)."""
    chunk = {"choices": [{"index": 0, "text": "a\x85b\u2028c\u2029d\x1ce"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
    events = [json.dumps(chunk, ensure_ascii=False), json.dumps(usage), "[DONE]"]
    body = "".join(f"data: {e}\r\n\r\n" for e in events)
    replay.routes[("POST", "/v1/completions")] = Route(200, body, "text/event-stream")
    r = client.ttft([1, 2, 3])
    assert r.ok and r.ttft_s is not None, r.body
    assert r.text == "a\x85b\u2028c\u2029d\x1ce" and r.prompt_tokens == 9
