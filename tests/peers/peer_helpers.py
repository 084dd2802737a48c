"""Shared settings for the peer fixtures and plain HTTP calls to a peer (real loopback requests)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from bench.peers import PeerServer
from bench.peers.pd_fleet import PD_BLOCKS

TIMEOUT = httpx.Timeout(120.0, connect=5.0)
# A test's own steps are bounded; the peer it shares (a session fixture) is not timed with
# the first test that asks for it: its start-up wait follows the peer instead
# (kvfence.startup_wait), which a busy machine can take well past any fixed figure.
PEER_TIMEOUT = pytest.mark.timeout(900, func_only=True)

# Small pools so pressure and cross-checks stay cheap: 64 blocks x 128 tokens for vLLM,
# 4,096 tokens in 2 explicit slots (2,048 each) for llama.cpp.
VLLM_BLOCKS = 64
VLLM_MAX_MODEL_LEN = 2048
LLAMA_CTX = 4096
LLAMA_SLOTS = 2


@dataclass(frozen=True, slots=True)
class PdShape:
    """What makes one vLLM P/D fleet differ from another: blocks per server and the NIXL lease
    (None: vLLM's default). Tests that ask for the same shape share one running fleet."""

    blocks: int = PD_BLOCKS
    kv_lease_s: int | None = None


DEFAULT_PD = PdShape()
# One 1,024-token request fills either server's pool (8 usable blocks of 128 tokens, the
# null block besides) and its lease is 1 s, which decode's heartbeats cannot extend.
LEASE_PD = PdShape(blocks=9, kv_lease_s=1)


def get_json(server: PeerServer, path: str) -> Any:
    resp = httpx.get(server.url + path, timeout=TIMEOUT)
    assert resp.status_code == 200, f"GET {path} -> {resp.status_code}: {resp.text[:300]}"
    return resp.json()


def get_text(server: PeerServer, path: str) -> str:
    resp = httpx.get(server.url + path, timeout=TIMEOUT)
    assert resp.status_code == 200, f"GET {path} -> {resp.status_code}: {resp.text[:300]}"
    return resp.text


def post(server: PeerServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, parsed JSON body) — error statuses are answers the tests inspect."""
    resp = httpx.post(
        server.url + path,
        content=json.dumps(body),
        timeout=TIMEOUT,
        headers={"content-type": "application/json"},
    )
    try:
        return resp.status_code, resp.json()
    except json.JSONDecodeError:
        return resp.status_code, resp.text


def complete(server: PeerServer, prompt: str | list[int], **fields: Any) -> dict[str, Any]:
    """A /v1/completions call that must succeed."""
    status, body = post(
        server, "/v1/completions", {"model": server.model, "prompt": prompt, **fields}
    )
    assert status == 200, f"completion -> {status}: {body}"
    assert isinstance(body, dict)
    return body


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) for every sample of metric `name` in Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    out: list[tuple[dict[str, str], float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out.append((dict(sample.labels), float(sample.value)))
    return out


def token_ids(n: int, *, start: int = 3, vocab: int = 512) -> list[int]:
    """n deterministic ordinary token ids (past the 3 specials) of the tiny vocabulary."""
    span = vocab - start
    return [start + (i * 37) % span for i in range(n)]
