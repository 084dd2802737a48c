"""vLLM: `/version`, `/metrics` (`vllm:cache_config_info`, NIXL series), `/v1/models`, `/tokenize`.

Read in vLLM 0.32's and 0.33's source (`v1/metrics/loggers.py`,
`v1/engine/core_client.py`, `v1/core/kv_cache_utils.py`, `config/cache.py`,
`distributed/kv_transfer/kv_connector/v1/nixl/stats.py`):

- `vllm:cache_config_info` is a gauge whose *labels* are the API server's
  one `CacheConfig` (every field, as strings), one series per engine index
  and otherwise identical. With data parallelism `num_gpu_blocks` is the
  **sum** over engines, `kv_cache_size_tokens` / `kv_cache_max_concurrency`
  whichever engine was ready first, `block_size` the last one's. Pools are
  per engine, so several series never name the smallest engine: the pool is
  then unknown (inconclusive), never the minimum of identical series.
- `kv_cache_size_tokens = int(kv_cache_max_concurrency × max_model_len)` is
  group-aware; `num_gpu_blocks × block_size` is wrong for hybrid models (one
  block pool shared by every KV-cache group, `block_size` the smallest
  group's). The gate uses `kv_cache_size_tokens`. vLLM refuses to start
  unless its pool holds one `max_model_len`: a start-up guarantee, never headroom.
- P/D over NIXL shows only in `/metrics`: `vllm:nixl_*` series on any NIXL
  node (counters `vllm:nixl_num_failed_transfers`, `…_kv_expired_reqs`,
  `…_notifications_after_expiry`), and `vllm:num_requests_kv_fetch_by_stage`
  only on a KV consumer (decode) or `kv_both` node.
- Length rule: prompt + max_tokens <= max_model_len.
- `GET /version` states the release (`{"version": "0.32.0"}`). The rules above
  are those of 0.32 and 0.33 (`READ`); a stated version outside them leaves
  the pool unknown, naming the version. Unstated (a proxy that passes only
  /metrics and /v1), the label set decides: `kv_cache_size_tokens` has been
  group-aware since it was added, and without it the pool is unknown.
- `kv_cache_size_tokens` is per engine and already whole-request tokens under
  tensor / pipeline parallelism (every worker holds the same block count) and
  decode context parallelism (each rank's share of `max_model_len` is what
  sizes a request); an offload tier is a cache, never counted in it.
- `--kv-offloading-size` (label `kv_offloading_size`) configures an offloading
  connector with role `kv_both`, so a single node exports the consumer-only
  `vllm:num_requests_kv_fetch_by_stage` without being anyone's decode node.
"""

from __future__ import annotations

from typing import ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import (
    RESERVED_KEY,
    Endpoints,
    Sample,
    Target,
    TargetFacts,
    json_int,
    models_fact,
    samples_named,
    tokenizer_fact,
)
from kvfence.audit.targets.versions import (
    ReadRange,
    Version,
    parse_version,
    said,
    version_fact,
)

READ = ReadRange("vLLM", (0, 32), (0, 33))
VERSION_PATH = "/version"
CACHE_INFO = "vllm:cache_config_info"
SRC = f"GET /metrics {CACHE_INFO}"
KV_FETCH = "vllm:num_requests_kv_fetch_by_stage"
# What each NIXL failure counter means in vLLM 0.32-0.33 (`nixl/base_worker.py`,
# `nixl/pull_worker.py`, `nixl/stats.py`); the counters check says it beside a move.
NIXL_MEANINGS = {
    "vllm:nixl_num_failed_transfers": (
        "a NIXL handshake, KV read or notification failed: decode did not get that "
        "request's KV and fails the request (kv_load_failure_policy 'fail', the default) "
        "or recomputes it ('recompute')"
    ),
    "vllm:nixl_num_kv_expired_reqs": (
        "prefill (this node counts it) freed a request's blocks because decode had not "
        "read them within the lease (kv_connector_extra_config kv_lease_duration, 30 s by "
        "default, extended by decode's heartbeats): the blocks are free for other "
        "requests while decode may still read them"
    ),
    "vllm:nixl_num_notifications_after_expiry": (
        "decode finished reading blocks whose lease had already run out (one per decode "
        "rank); if prefill gave them to another request meanwhile, decode answered from "
        "that request's KV, and neither side checks"
    ),
}
NIXL_COUNTERS = tuple(NIXL_MEANINGS)


def _label_int(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def _label_float(labels: dict[str, str], key: str) -> float | None:
    try:
        return float(labels[key])
    except (KeyError, ValueError):
        return None


def is_hybrid(labels: dict[str, str]) -> bool:
    """A model with more than one KV-cache group shape (Mamba / hybrid attention)."""
    return labels.get("mamba_block_size", "None") != "None"


def offloading(samples: list[Sample] | None) -> str | None:
    """The `kv_offloading_size` label (GiB) when an offloading connector is configured."""
    for s in samples_named(samples or [], CACHE_INFO):
        size = s.labels.get("kv_offloading_size", "None")
        if size not in ("None", ""):
            return size
    return None


def pd_role(samples: list[Sample] | None) -> Fact | None:
    """The node's P/D role as its metrics show it; None when it shows no KV transfer."""
    names = {s.name for s in samples or []}
    nixl = any(n.startswith("vllm:nixl_") for n in names)
    offload = offloading(samples)
    if KV_FETCH in names and offload is not None and not nixl:
        return Fact(
            "unified",
            f"GET /metrics {CACHE_INFO} kv_offloading_size={offload}",
            f"an offloading connector (kv_both) exports {KV_FETCH} on a single node: it "
            "serves whole requests, its pool is the one the gate needs",
        )
    if KV_FETCH in names:
        return Fact(
            "decode",
            f"GET /metrics {KV_FETCH}",
            "exported only by a KV consumer (decode) or kv_both node",
        )
    if any(n.startswith("vllm:nixl_") for n in names):
        return Fact("prefill", "GET /metrics vllm:nixl_* without " + KV_FETCH, "kv_producer")
    return None


def nixl_counters(samples: list[Sample] | None) -> dict[str, Fact]:
    """NIXL failure counters (summed over engines); unknown ones on a NIXL node are reported."""
    names = {s.name for s in samples or []}
    if not any(n.startswith("vllm:nixl_") for n in names):
        return {}
    out: dict[str, Fact] = {}
    for base in NIXL_COUNTERS:
        found = samples_named(samples or [], f"{base}_total") or samples_named(samples or [], base)
        out[base] = (
            Fact(
                int(sum(s.value for s in found)), f"GET /metrics {base}_total", NIXL_MEANINGS[base]
            )
            if found
            else Fact.unknown(f"GET /metrics {base}_total", "absent on a NIXL node")
        )
    return out


class VllmTarget(Target):
    engine: ClassVar[str] = "vllm"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        samples = endpoints.metrics()
        if samples and any(s.name.startswith("vllm:") for s in samples):
            return "GET /metrics exposes vllm:* metrics"
        models = endpoints.json("/v1/models")
        data = (models or {}).get("data")
        if (
            isinstance(data, list)
            and data
            and isinstance(data[0], dict)
            and data[0].get("owned_by") == "vllm"
        ):
            return 'GET /v1/models data[0].owned_by == "vllm"'
        return None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        ep = Endpoints(client)
        model, entry = models_fact(ep)
        facts = TargetFacts(engine=Fact("vllm", "GET /metrics vllm:*"), model=model)
        stated = stated_version(ep)
        facts.extra["version"] = stated
        mml, _ = json_int(entry, "max_model_len")
        facts.context_length, facts.max_input = _limits(mml)
        samples = ep.metrics()
        infos = samples_named(samples or [], CACHE_INFO)
        if samples is None:
            facts.pool_tokens = Fact.unknown(SRC, "/metrics did not answer")
        elif not infos:
            facts.pool_tokens = Fact.unknown(SRC, "gauge absent")
        else:
            cache_facts(facts, [s.labels for s in infos], stated)
        role = pd_role(samples)
        if role is not None:
            facts.extra["pd_role"] = role
            facts.extra["kv_transfer"] = Fact(
                "NIXL" if any(s.name.startswith("vllm:nixl_") for s in samples or []) else "other",
                "GET /metrics vllm:nixl_*",
            )
        facts.cache_salt_supported = Fact(
            True, "vLLM OpenAI API (cache_salt, since 0.9)", "the prefix-sharing check verifies it"
        )
        facts.tokenizer = tokenizer_fact(client)
        facts.counters = nixl_counters(samples)
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
            found = samples_named(samples or [], name)
            if found:
                facts.counters[name] = Fact(
                    int(sum(s.value for s in found)), f"GET /metrics {name}", "(informational)"
                )
        return facts

    def read_counters(self, client: ProbeClient) -> dict[str, Fact]:
        return nixl_counters(Endpoints(client).metrics())


def _limits(mml: int | None) -> tuple[Fact, Fact]:
    """(context, longest prompt with max_tokens=1) from /v1/models max_model_len."""
    src = "GET /v1/models data[0].max_model_len"
    if mml is None:
        unknown = Fact.unknown(src, "absent")
        return unknown, unknown
    rule = "vLLM rejects prompt + max_tokens > max_model_len"
    return Fact(mml, src), Fact(mml - 1, f"{src} - 1", rule)


def stated_version(ep: Endpoints) -> Fact:
    """`GET /version` as vLLM states it."""
    body = ep.json(VERSION_PATH)
    why = f"GET {VERSION_PATH} {ep.get(VERSION_PATH).outcome()}" if body is None else "absent"
    return version_fact((body or {}).get("version"), f"GET {VERSION_PATH} version", why)


def cache_facts(
    facts: TargetFacts,
    series: list[dict[str, str]],
    stated: Fact | None = None,
) -> None:
    """Pool, page size and prefix caching from the `vllm:cache_config_info` series, by the
    rules of the version the engine states (`stated`, from GET /version)."""
    first = series[0]
    bs = _label_int(first, "block_size")
    if bs is not None:
        facts.page_size = Fact(bs, f"{SRC} block_size")
    epc = first.get("enable_prefix_caching")
    if epc in ("True", "False", "true", "false"):
        facts.prefix_caching = Fact(epc.lower() == "true", f"{SRC} enable_prefix_caching")
    conc = _label_float(first, "kv_cache_max_concurrency")
    if conc is not None:
        facts.extra["kv_cache_max_concurrency"] = Fact(
            conc, f"{SRC} kv_cache_max_concurrency", "whole max_model_len requests the pool holds"
        )
    if len(series) > 1:
        facts.pool_tokens = _data_parallel_pool(series)
        facts.extra["data_parallel_engines"] = Fact(len(series), f"{SRC} (one series per engine)")
    else:
        facts.pool_tokens = _one_engine_pool(first)
        reserved = null_block_share(first)
        if reserved is not None and facts.pool_tokens.known:
            facts.extra[RESERVED_KEY] = reserved
    stated = stated or Fact.unknown(f"GET {VERSION_PATH} version", "not read")
    facts.pool_tokens = by_version(facts.pool_tokens, stated, parse_version(stated.value))
    size = first.get("kv_offloading_size", "None")
    if size not in ("None", ""):
        facts.extra["kv_offloading"] = Fact(
            f"{size} GiB ({first.get('kv_offloading_backend', '?')})",
            f"{SRC} kv_offloading_size / kv_offloading_backend",
            "an offload tier caches evicted prefixes; it is not KV a running request can use, "
            "so the pool stays the device pool",
        )


def by_version(pool: Fact, stated: Fact, version: Version | None) -> Fact:
    """The pool as the stated version's rules read it; unknown outside the versions read."""
    if version is None:
        if not pool.known:
            return pool
        return Fact(
            pool.value,
            pool.source,
            f"{pool.note}; vLLM {said(stated)}: the label set decides, and "
            "kv_cache_size_tokens is group-aware wherever it exists",
        )
    why = READ.unknown_rules(version, stated, f"{CACHE_INFO}'s pool labels")
    if why is not None:
        seen = f" (it reads {pool.value:,} by {READ.named()}'s rules)" if pool.known else ""
        return Fact.unknown(f"{pool.source}; {stated.source} {stated.value}", why + seen)
    rule = f"vLLM {stated.value} ({stated.source}), rules of {READ.named()}"
    if not pool.known:
        return Fact.unknown(pool.source, f"{pool.note}; {rule}")
    return Fact(pool.value, pool.source, f"{rule}: {pool.note}")


def null_block_share(labels: dict[str, str]) -> Fact | None:
    """One block's share of `kv_cache_size_tokens`: the block pool sets block 0 aside as its
    null block (a placeholder no request can use) while the size counts every block."""
    tokens = _label_int(labels, "kv_cache_size_tokens")
    blocks = _label_int(labels, "num_gpu_blocks")
    if tokens is None or not blocks:
        return None
    return Fact(
        -(-tokens // blocks),
        f"{SRC} kv_cache_size_tokens / num_gpu_blocks",
        f"block 0 of the {blocks} is vLLM's null block, a placeholder",
    )


def _one_engine_pool(labels: dict[str, str]) -> Fact:
    tokens = _label_int(labels, "kv_cache_size_tokens")
    blocks, bs = _label_int(labels, "num_gpu_blocks"), _label_int(labels, "block_size")
    guarantee = "vLLM refuses to start below 1 × max_model_len: a guarantee, never headroom"
    if tokens is not None:
        note = "group-aware (kv_cache_max_concurrency × max_model_len); " + guarantee
        if blocks is not None and bs is not None and blocks * bs != tokens:
            note += f"; num_gpu_blocks×block_size = {blocks * bs} (not used: wrong for hybrids)"
        return Fact(tokens, f"{SRC} kv_cache_size_tokens", note)
    if is_hybrid(labels):
        return Fact.unknown(
            f"{SRC} kv_cache_size_tokens",
            "absent, and blocks × block_size is wrong for a hybrid model (mamba_block_size set)",
        )
    if blocks is not None and bs is not None:
        return Fact.unknown(
            f"{SRC} kv_cache_size_tokens",
            f"absent; num_gpu_blocks×block_size = {blocks * bs} is the pool only for a model "
            "with one uniform KV-cache group, which these labels cannot show (sliding-window "
            "and Mamba hybrids draw every group's blocks from one pool)",
        )
    return Fact.unknown(SRC, "labels lack kv_cache_size_tokens and num_gpu_blocks/block_size")


def _data_parallel_pool(series: list[dict[str, str]]) -> Fact:
    """Several engines behind one API server: their series carry one config, not their pools."""
    engines = sorted(s.get("engine", "?") for s in series)
    blocks = _label_int(series[0], "num_gpu_blocks")
    tokens = _label_int(series[0], "kv_cache_size_tokens")
    return Fact.unknown(
        f"{SRC} (engines {', '.join(engines)})",
        f"{len(series)} data-parallel engines export one config: num_gpu_blocks={blocks} is the "
        f"sum over engines and kv_cache_size_tokens={tokens} is whichever engine was ready first, "
        "so the smallest engine's pool is not in these labels — audit each engine on its own "
        "endpoint (or through vllm-router's /workers)",
    )
