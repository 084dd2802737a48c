"""Signal 3's raw material: latency histograms by prompt length and one JSON line per request."""

from __future__ import annotations

import json
from pathlib import Path

from serve_helpers import serve

from kvfence.audit.checks.latency.check import parse_log_lines
from kvfence.serve.build import PoolSizes
from kvfence.serve.request_log import LATENCY_BUCKETS, prompt_bucket, tenant_hash


def test_prompt_buckets_are_powers_of_two_capped_at_context() -> None:
    assert [prompt_bucket(n, 512) for n in (1, 16, 17, 100, 511, 512)] == [
        "16", "16", "32", "128", "512", "512",
    ]  # fmt: skip
    assert prompt_bucket(3000, 2048) == "3000"  # never a bucket below the prompt itself
    assert LATENCY_BUCKETS[0] <= 0.00025  # a millisecond prefill lands in its own bucket


def test_histograms_and_log_lines_per_request(checkpoint: Path, tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    with serve(
        checkpoint,
        kind="llama",
        pools=PoolSizes(prefill_pages=128, decode_pages=128),
        context_length=512,
        request_log=log,
    ) as s:
        for n in (8, 8, 200, 200, 480):
            r = s.post("/v1/completions", json={"prompt": [5] * n, "max_tokens": 2})
            assert r.status_code == 200, r.text
        refused = s.post("/v1/completions", json={"prompt": [5] * 600, "max_tokens": 2})
        assert refused.status_code == 400
        m = s.metrics()
    for name in ("kvfence_time_to_first_token_seconds", "kvfence_prefill_seconds"):
        assert m[f"{name}_count{{prompt_tokens_le=16}}"] == 2
        assert m[f"{name}_count{{prompt_tokens_le=256}}"] == 2
        assert m[f"{name}_count{{prompt_tokens_le=512}}"] == 1
        assert m[f"{name}_sum{{prompt_tokens_le=512}}"] > 0
    assert m["kvfence_request_prompt_tokens_total{prompt_tokens_le=256}"] == 400
    # Same prompt twice: the second one's full pages come from the tenant's own cache (I8).
    assert m["kvfence_request_cached_tokens_total{prompt_tokens_le=256}"] >= 192
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["outcome"] for x in lines] == ["finished"] * 5 + ["rejected"]
    first = lines[0]
    assert first["tenant_hash"] == tenant_hash("a") and "a" not in first.values()
    assert first["prompt_tokens"] == 8 and first["completion_tokens"] == 2
    assert 0 < first["prefill_s"] <= first["ttft_s"]
    assert lines[3]["cached_tokens"] >= 192 and lines[2]["cached_tokens"] == 0
    # The audit reads the log like vLLM's: engine prefill time, one sample per finished request.
    parsed = parse_log_lines(log.read_text().splitlines())
    assert len(parsed.samples) == 5 and {x.kind for x in parsed.samples} == {"prefill"}
    assert [x.prompt_tokens for x in parsed.samples] == [8, 8, 200, 200, 480]


def test_no_request_log_by_default(checkpoint: Path, tmp_path: Path) -> None:
    with serve(checkpoint, kind="mirror", pools=PoolSizes(64, 64), context_length=256) as s:
        r = s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200
        assert s.metrics()["kvfence_prefill_seconds_count{prompt_tokens_le=16}"] == 1
    assert list(tmp_path.iterdir()) == []
