"""The same engine metrics on the hub: kvfence's router over prefill and decode worker processes.

The hub serves the app every kvfence server serves (create_app); its pools are
the workers' own, read from the status each worker sends. So the KV usage here
is what the workers report: the decode pool in use while a request decodes, and
the prefill worker's prefix-cache pages reported as evictable once it ends.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.append(str(Path(__file__).resolve().parents[1] / "pd"))  # pd_helpers, after all else
from pd_helpers import Cluster, cluster

pytestmark = pytest.mark.slow

PROMPT = [5] * 300  # 18 full pages of 16 tokens
PAGES = 320  # per pool: the tiny model's context (4,096) x the gate's headroom, in pages
Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _metrics(c: Cluster) -> Metrics:
    r = httpx.get(c.url + "/metrics", headers={"Authorization": f"Bearer {c.key('operator')}"})
    assert r.status_code == 200, r.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def _gauge(c: Cluster, name: str, **labels: str) -> float:
    return _metrics(c)[(name, tuple(sorted({"model_name": c.model, **labels}.items())))]


def _until(what: str, done: Callable[[], bool], deadline_s: float = 120.0) -> None:
    """Poll `done`; the deadline bounds a hung cluster (workers report every half second)."""
    end = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what} after {deadline_s:g} s")
        time.sleep(0.1)


def test_hub_reports_running_usage_and_evictable_cache(tmp_path: Path) -> None:
    from kvfence.model.tiny import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    with cluster(checkpoint, kind="mirror", kv_pages=f"prefill={PAGES},decode={PAGES}") as c:
        body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        first = threading.Event()
        done = threading.Event()

        failed: list[str] = []

        def stream() -> None:
            headers = {"Authorization": f"Bearer {c.key()}"}
            try:
                with httpx.stream("POST", c.url + "/v1/completions", json=body, headers=headers,
                                  timeout=300) as r:  # fmt: skip
                    if r.status_code != 200:
                        failed.append(f"{r.status_code}: {r.read()!r}")
                    for line in r.iter_lines():
                        if line.startswith("data: ") and '"text"' in line:
                            first.set()
            except httpx.HTTPError as e:
                failed.append(repr(e))
            finally:
                done.set()

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        _until("first token at the client", lambda: first.is_set() or done.is_set())
        assert first.is_set(), f"the stream ended without a token: {failed}"

        def decoding() -> bool:  # the decode worker reports the request's pages in use
            usage = _gauge(c, "kvfence_kv_cache_usage_perc", role="decode")
            running = _gauge(c, "kvfence_num_requests_running")
            assert running == 1 and not done.is_set(), f"ended before a report: {usage}"
            return usage >= len(PROMPT) // 16 / PAGES

        _until("decode pages in use", decoding)
        client.join(300)
        assert done.is_set() and not failed, f"the stream did not end well: {failed}"
        c.wait_quiet()
        # Ended: nothing running, and the prompt's pages the prefill worker keeps cached are
        # reported evictable, so neither pool is in use.
        for name in ("kvfence_num_requests_running", "kvfence_num_requests_waiting"):
            assert _gauge(c, name) == 0
        _until("the workers' idle report", lambda: all(
            _gauge(c, "kvfence_kv_cache_usage_perc", role=r) == 0 for r in ("prefill", "decode")
        ))  # fmt: skip
        pools = c.info()["pools"]
        assert isinstance(pools, list)
        prefill = [p for p in pools if p["role"] == "prefill"]
        assert prefill[0]["pages_used"] >= len(PROMPT) // 16  # held by the prefix cache ...
        assert prefill[0]["pages_cached"] == prefill[0]["pages_used"]  # ... and evictable
        assert _gauge(c, "kvfence_e2e_request_latency_seconds_count") == 1
