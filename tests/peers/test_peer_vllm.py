"""Real vLLM (CPU) on the tiny checkpoint: the facts and behaviours the audit relies on."""

from __future__ import annotations

import pytest
from bench.peers import PeerServer, vllm_pool_tokens
from peer_helpers import (
    PEER_TIMEOUT,
    VLLM_BLOCKS,
    VLLM_MAX_MODEL_LEN,
    complete,
    get_json,
    get_text,
    metric_samples,
    post,
    token_ids,
)

pytestmark = [pytest.mark.slow, pytest.mark.peers, PEER_TIMEOUT]


def test_models_reports_configured_max_model_len(vllm_peer: PeerServer) -> None:
    models = get_json(vllm_peer, "/v1/models")
    entry = models["data"][0]
    assert entry["id"] == vllm_peer.model
    assert entry["max_model_len"] == VLLM_MAX_MODEL_LEN


def test_pool_size_agrees_across_metrics_and_startup_log(vllm_peer: PeerServer) -> None:
    samples = metric_samples(get_text(vllm_peer, "/metrics"), "vllm:cache_config_info")
    assert samples, "vllm:cache_config_info missing from /metrics"
    labels = samples[0][0]
    blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    # --num-gpu-blocks-override sets the CPU pool despite the label's name; CPU blocks are 128.
    assert blocks == VLLM_BLOCKS
    assert block_size == 128
    logged = vllm_pool_tokens(vllm_peer.log_text())
    assert logged == blocks * block_size, (
        f"log says {logged} tokens, /metrics {blocks}x{block_size}"
    )


def test_tokenize_reports_count_and_max_model_len(vllm_peer: PeerServer) -> None:
    status, body = post(
        vllm_peer, "/tokenize", {"model": vllm_peer.model, "prompt": "Hello, world!"}
    )
    assert status == 200, body
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == VLLM_MAX_MODEL_LEN


def test_temperature_zero_repeats_exactly(vllm_peer: PeerServer) -> None:
    fields = {"max_tokens": 24, "temperature": 0.0, "logprobs": 1}
    first = complete(vllm_peer, "The tenant sends a request", **fields)
    second = complete(vllm_peer, "The tenant sends a request", **fields)
    a, b = first["choices"][0], second["choices"][0]
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    assert a["text"] == b["text"]
    assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("extra", [0, 10])
def test_prompt_leaving_no_room_for_output_is_400(vllm_peer: PeerServer, extra: int) -> None:
    # A prompt of max_model_len tokens already fails: no room is left for one output token.
    status, body = post(
        vllm_peer,
        "/v1/completions",
        {
            "model": vllm_peer.model,
            "prompt": token_ids(VLLM_MAX_MODEL_LEN + extra),
            "max_tokens": 1,
        },
    )
    assert status == 400, body


def test_max_tokens_over_max_model_len_is_400(vllm_peer: PeerServer) -> None:
    status, body = post(
        vllm_peer,
        "/v1/completions",
        {"model": vllm_peer.model, "prompt": token_ids(16), "max_tokens": VLLM_MAX_MODEL_LEN + 1},
    )
    assert status == 400, body


def test_prompt_plus_max_tokens_over_the_limit_is_cut_not_refused(vllm_peer: PeerServer) -> None:
    # vLLM 0.32 refuses only max_tokens > max_model_len; a prompt + max_tokens sum over
    # the limit is cut to what fits (max_model_len - prompt), ending with "length".
    prompt_len = VLLM_MAX_MODEL_LEN - 8
    body = complete(
        vllm_peer,
        token_ids(prompt_len),
        max_tokens=100,
        temperature=0.0,
        ignore_eos=True,
    )
    assert body["usage"]["prompt_tokens"] == prompt_len
    assert body["usage"]["completion_tokens"] == VLLM_MAX_MODEL_LEN - prompt_len
    assert body["choices"][0]["finish_reason"] == "length"


def test_prompt_that_fits_is_served_with_cached_token_details(vllm_peer: PeerServer) -> None:
    # The edge of the 400 above: the longest prompt leaving room for one token is accepted.
    body = complete(vllm_peer, token_ids(VLLM_MAX_MODEL_LEN - 1), max_tokens=1, temperature=0.0)
    assert body["usage"]["prompt_tokens"] == VLLM_MAX_MODEL_LEN - 1
    # --enable-prompt-tokens-details makes the cached-token count appear.
    assert "cached_tokens" in (body["usage"].get("prompt_tokens_details") or {})
