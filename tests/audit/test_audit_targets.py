"""Target adapters read the right numbers, with sources, from engine-shaped responses."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from audit_replay import ReplayServer, Route

from kvfence.audit.base import Budget, BudgetExhausted
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.registry import DetectionError, detect, make_target


@pytest.fixture
def client(replay: ReplayServer) -> Iterator[ProbeClient]:
    c = ProbeClient(replay.url, api_key="k", budget=Budget(max_requests=50))
    yield c
    c.close()


def test_vllm_facts(replay: ReplayServer, client: ProbeClient) -> None:
    replay.file("/metrics", "vllm_metrics.txt")
    replay.file("/v1/models", "vllm_models.json")
    replay.json("/tokenize", {"count": 2, "max_model_len": 2048, "tokens": [1, 2]}, method="POST")
    target = detect(replay.url, client)
    assert target.engine == "vllm"
    facts = target.facts(client)
    assert facts.pool_tokens.value == 64 * 128
    assert "num_gpu_blocks×block_size" in facts.pool_tokens.source
    assert facts.page_size.value == 128
    assert facts.context_length.value == 2048
    assert facts.max_input.value == 2047
    assert facts.prefix_caching.value is True
    assert facts.tokenizer.value == "/tokenize"


def test_vllm_data_parallel_uses_smallest_engine(replay: ReplayServer, client: ProbeClient) -> None:
    text = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100",'
        'enable_prefix_caching="False"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="80",'
        'enable_prefix_caching="False"} 1.0\n'
    )
    replay.routes[("GET", "/metrics")] = Route(200, text, "text/plain")
    replay.file("/v1/models", "vllm_models.json")
    facts = make_target(replay.url, "vllm", client).facts(client)
    assert facts.pool_tokens.value == 80 * 16
    assert facts.extra["pool_tokens_all_engines"].value == 180 * 16
    assert facts.prefix_caching.value is False
    assert facts.tokenizer.value == "calibrated from usage.prompt_tokens"


def test_llamacpp_claims_only_the_per_slot_lower_bound(
    replay: ReplayServer, client: ProbeClient
) -> None:
    replay.file("/props", "llamacpp_props.json")
    replay.file("/slots", "llamacpp_slots.json")
    replay.file("/v1/models", "llamacpp_models.json")
    replay.file("/metrics", "llamacpp_metrics.txt")
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


def test_tgi_facts_old_and_new(replay: ReplayServer, client: ProbeClient) -> None:
    replay.file("/info", "tgi_info.json")
    target = detect(replay.url, client)
    assert target.engine == "tgi"
    facts = target.facts(client)
    assert facts.pool_tokens.value == 37872
    assert facts.max_input.value == 1024
    assert facts.context_length.value == 2048
    assert facts.model.value == "bigscience/bloom-560m"


def test_tgi_new_has_no_pool(replay: ReplayServer, client: ProbeClient) -> None:
    replay.file("/info", "tgi_info_new.json")
    facts = make_target(replay.url, "tgi", client).facts(client)
    assert not facts.pool_tokens.known
    assert "absent" in facts.pool_tokens.note


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
