"""Real llama-server on the tiny checkpoint (converted to GGUF by llama.cpp's own converter)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.peers import (
    LlamaSlotLayout,
    PeerCache,
    PeerServer,
    llamacpp_n_ctx,
    llamacpp_slot_layout,
    start_llamacpp,
)
from peer_helpers import (
    LLAMA_CTX,
    LLAMA_SLOTS,
    PEER_TIMEOUT,
    complete,
    get_json,
    get_text,
    metric_samples,
    post,
    token_ids,
)

pytestmark = [pytest.mark.slow, pytest.mark.peers, PEER_TIMEOUT]


def test_props_report_per_slot_ctx_and_slots(llamacpp_peer: PeerServer) -> None:
    props = get_json(llamacpp_peer, "/props")
    per_slot = props["default_generation_settings"]["n_ctx"]
    assert props["total_slots"] == LLAMA_SLOTS
    # With -np N each slot owns n_ctx / N of the pool the log reports.
    assert per_slot == LLAMA_CTX // LLAMA_SLOTS
    layout = llamacpp_slot_layout(llamacpp_peer.log_text())
    assert layout == LlamaSlotLayout(LLAMA_SLOTS, per_slot, kv_unified=False)
    assert llamacpp_n_ctx(llamacpp_peer.log_text()) == per_slot * props["total_slots"] == LLAMA_CTX


def test_automatic_slots_share_one_pool_each_reports_whole(
    llamacpp_cache: PeerCache, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    # The pool trap (PEERS.md): without -np every slot reports the whole -c, and the log alone
    # says they share it. llama-server starts in about a second, so a second one is cheap.
    with start_llamacpp(
        tiny_checkpoint, ctx_size=LLAMA_CTX, threads=2, log_dir=tmp_path, cache=llamacpp_cache
    ) as auto:
        props = get_json(auto, "/props")
        assert props["default_generation_settings"]["n_ctx"] == LLAMA_CTX
        assert props["total_slots"] > 1
        layout = llamacpp_slot_layout(auto.log_text())
        assert layout is not None and layout.kv_unified
        assert layout.n_slots == props["total_slots"]
        assert layout.pool_tokens == LLAMA_CTX  # shared, not total_slots x n_ctx


def test_slots_and_models_agree_with_props(llamacpp_peer: PeerServer) -> None:
    slots = get_json(llamacpp_peer, "/slots")
    assert [s["n_ctx"] for s in slots] == [LLAMA_CTX // LLAMA_SLOTS] * LLAMA_SLOTS
    meta = get_json(llamacpp_peer, "/v1/models")["data"][0]["meta"]
    assert meta["n_ctx_train"] == 4096


def test_overlong_prompt_is_400_exceed_context_size(llamacpp_peer: PeerServer) -> None:
    per_slot = LLAMA_CTX // LLAMA_SLOTS
    status, body = post(
        llamacpp_peer,
        "/v1/completions",
        {"model": llamacpp_peer.model, "prompt": token_ids(per_slot + 10), "max_tokens": 1},
    )
    assert status == 400, body
    error = body.get("error", body)  # OpenAI-style envelope around llama.cpp's error
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == per_slot
    assert error["n_prompt_tokens"] >= per_slot + 10


def test_temperature_zero_repeats_exactly(llamacpp_peer: PeerServer) -> None:
    fields = {"max_tokens": 24, "temperature": 0.0, "cache_prompt": False}
    first = complete(llamacpp_peer, "The tenant sends a request", **fields)
    second = complete(llamacpp_peer, "The tenant sends a request", **fields)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"] > 0


def test_metrics_count_prompt_tokens(llamacpp_peer: PeerServer) -> None:
    def prompt_tokens() -> float:
        samples = metric_samples(
            get_text(llamacpp_peer, "/metrics"), "llamacpp:prompt_tokens_total"
        )
        assert samples, "llamacpp:prompt_tokens_total missing from /metrics (--metrics)"
        return samples[0][1]

    before = prompt_tokens()
    body = complete(llamacpp_peer, token_ids(40), max_tokens=1, cache_prompt=False)
    assert prompt_tokens() - before == body["usage"]["prompt_tokens"] == 40
