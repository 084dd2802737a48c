"""The guard reads the engine's own TTFT / prefill histograms (watch.engine_latency).

Against a real kvfence server on loopback (the tiny real transformer, in-process):
an interval's delta holds exactly the probes the guard sent, in the length buckets
it sent them, and the engine's clock is never slower than the guard's. On the
workers-ai-2026 lab (over-pool prompts prefill a 1-token placeholder) every long
prefill the engine logs is as fast as its short ones; on the hardened engine they
are not — the corroboration can fail. It is never an alarm by itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvfence.audit.targets.base import Sample
from kvfence.lab.profiles import PROFILES
from kvfence.lab.scenario import OPERATOR, TENANT_A, TENANT_B, lab_server
from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.serve.app import create_app
from kvfence.serve.build import PoolSizes, build_local
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread
from kvfence.watch.engine_latency import PREFILL, EngineLatency, Histogram, read_histograms
from kvfence.watch.guard import GuardConfig, Interval, Keys, TargetGuard
from kvfence.watch.metrics import WatchMetrics
from kvfence.watch.probes import PAIRS_PER_ROUND, ROUND

# Timing only, every interval, no spacing: the guard's probes are the only traffic.
CONFIG = GuardConfig(interval_s=1.0, canary=False, max_target_share=1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("watch-ckpt") / "tiny", seed=0)


@contextmanager
def hardened(checkpoint: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """Every defence on, pools well above the context (512), real tiny transformer."""
    parts = build_local(
        checkpoint,
        kind="llama",
        context_length=512,
        pools=PoolSizes(prefill_pages=128, decode_pages=128),
        prefix_cache=False,
    )
    tenants = TenantRegistry.generate((TENANT_A, TENANT_B))
    keys = {t.name: t.keys[0] for t in tenants.tenants} | {OPERATOR: tenants.operator_keys[0]}
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    parts.pipeline.start()
    try:
        with ServerThread(app) as srv:
            yield srv.url, keys
    finally:
        parts.pipeline.stop()


def guard_on(url: str, keys: dict[str, str]) -> TargetGuard:
    return TargetGuard(
        url, "kvfence", Keys(keys[TENANT_A], keys[TENANT_B], keys[OPERATOR]), CONFIG, WatchMetrics()
    )


def cycles(guard: TargetGuard, n: int) -> list[Interval]:
    out = [guard.cycle() for _ in range(n)]
    assert all(i.facts_known for i in out), [i.error for i in out]
    return out


def short_traffic(url: str, key: str, n: int = 12) -> None:
    """Other traffic: ``n`` 16-token prompts (the short bucket the evidence compares with)."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for i in range(n):
            body = {"model": model, "prompt": [100 + i + j for j in range(16)], "max_tokens": 1}
            assert http.post("/v1/completions", json=body).status_code == 200


def sample(guard: TargetGuard, name: str, **labels: str) -> float | None:
    value = guard.metrics.registry.get_sample_value(name, {"target": guard.url, **labels})
    return value


def test_an_interval_delta_is_exactly_the_guards_probes_on_real_kvfence(checkpoint: Path) -> None:
    with hardened(checkpoint) as (url, keys):
        guard = guard_on(url, keys)
        try:
            cycles(guard, 1)  # gate + boundary + a round: the snapshot the next delta starts at
            before = len(guard.timing.samples)
            cycles(guard, 1)
        finally:
            guard.close()
    new = list(guard.timing.samples)[before:]
    assert len(new) == ROUND  # one timing round, nothing else sent to a completion route
    long_n = max(s.prompt_tokens for s in new)
    assert long_n == 511 and sum(s.prompt_tokens == long_n for s in new) == PAIRS_PER_ROUND
    delta = guard.engine_latency.delta
    for metric in (PREFILL, "kvfence_time_to_first_token_seconds"):
        counts = {b: h.count for (m, b), h in delta.items() if m == metric}
        assert sum(counts.values()) == ROUND, counts  # every probe, once, and nothing else
        assert counts["512"] == PAIRS_PER_ROUND, counts  # 511 tokens: the 512 bucket
        exported = sample(
            guard,
            "kvfence_guard_engine_latency_observations",
            metric=metric,
            prompt_tokens_le="512",
        )
        assert exported == PAIRS_PER_ROUND
    # The engine's clock has no network in it: the long probes' fastest engine-side TTFT
    # lies in a bucket whose lower edge is at most the guard's fastest measured TTFT.
    h = delta[("kvfence_time_to_first_token_seconds", "512")]
    first = next(i for i, c in enumerate(h.cumulative) if c > 0)
    lower = h.edges[first - 1] if first else 0.0
    assert lower <= min(s.seconds for s in new if s.prompt_tokens == long_n)
    assert sample(guard, "kvfence_guard_engine_histograms") == len(delta) >= 2


def test_the_lab_placeholder_shows_in_the_engines_own_long_bucket(checkpoint: Path) -> None:
    """Corroboration that can fail: all long prefills as fast as short ones on the lab, on
    the hardened engine (a real forward pass over 511 tokens) not one of them."""
    lab_faults = PROFILES["workers-ai-2026"].faults
    with lab_server(checkpoint, lab_faults, model_kind="llama") as lab:
        on_lab = guard_on(lab.url, lab.keys)
        try:
            cycles(on_lab, 2)
            short_traffic(lab.url, lab.keys[TENANT_A])
            cycles(on_lab, 1)
        finally:
            on_lab.close()
    with hardened(checkpoint) as (url, keys):
        on_hardened = guard_on(url, keys)
        try:
            cycles(on_hardened, 2)
            short_traffic(url, keys[TENANT_A])
            cycles(on_hardened, 1)
        finally:
            on_hardened.close()
    lab_ev = on_lab.engine_latency.long_bucket(511)
    ok_ev = on_hardened.engine_latency.long_bucket(511)
    assert lab_ev is not None and ok_ev is not None
    print(f"\nlab: {lab_ev.note()}\nhardened: {ok_ev.note()}")
    assert lab_ev.observations == lab_ev.as_fast_as_short == PAIRS_PER_ROUND
    assert ok_ev.observations == PAIRS_PER_ROUND and ok_ev.as_fast_as_short == 0
    assert (sample(on_lab, "kvfence_guard_engine_fast_long_prefills_total") or 0) > 0
    # Corroboration is a note, never an alarm: three rounds cannot reach the budget's alpha.
    assert on_lab.last is not None and not on_lab.last.too_fast


def test_histogram_deltas_quantiles_and_resets() -> None:
    def page(counts: tuple[float, ...], bucket: str = "512") -> list[Sample]:
        edges = ("0.001", "0.002", "0.004", "+Inf")
        labels = {"prompt_tokens_le": bucket}
        return [
            Sample(f"{PREFILL}_bucket", {**labels, "le": e}, c)
            for e, c in zip(edges, counts, strict=True)
        ] + [Sample("vllm:time_to_first_token_seconds_bucket", {"le": "+Inf", "engine": "0"}, 3)]

    hist = read_histograms(page((1, 2, 4, 4)))
    assert set(hist) == {(PREFILL, "512"), ("vllm:time_to_first_token_seconds", "")}
    h = hist[(PREFILL, "512")]
    assert h.count == 4 and h.quantile_edge(0.05) == 0.001 and h.quantile_edge(0.5) == 0.002
    assert h.under(0.002) == 2 and h.under(0.0005) == 0
    assert math.isinf(Histogram((0.001, math.inf), (0, 2)).quantile_edge(0.5) or 0)
    lat = EngineLatency()
    lat.update(page((1, 2, 4, 4)))
    assert lat.update(page((1, 3, 7, 9)))[(PREFILL, "512")].cumulative == (0, 1, 3, 5)
    # A count that went down is a restart: the new page is the delta (as rate() reads it).
    assert lat.update(page((0, 1, 1, 1)))[(PREFILL, "512")].cumulative == (0, 1, 1, 1)
    assert lat.update(None) == {}  # unreadable /metrics: no delta, never a stale one
