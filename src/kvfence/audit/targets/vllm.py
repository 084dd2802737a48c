"""vLLM: `/metrics` `vllm:cache_config_info`, `/v1/models`, `/tokenize`.

`vllm:cache_config_info` is a gauge whose *labels* carry the cache config:
`num_gpu_blocks` (the KV pool in blocks — on CPU too, despite the name),
`block_size`, `enable_prefix_caching`, and on newer releases
`kv_cache_size_tokens`. With data parallelism each engine exports its own
sample (an `engine` label). vLLM's length rule is prompt + max_tokens <=
max_model_len.
"""

from __future__ import annotations

from typing import ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import (
    Endpoints,
    Target,
    TargetFacts,
    json_int,
    models_fact,
    samples_named,
    tokenizer_fact,
)

CACHE_INFO = "vllm:cache_config_info"


def _label_int(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


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
        mml, _ = json_int(entry, "max_model_len")
        if mml is not None:
            facts.context_length = Fact(mml, "GET /v1/models data[0].max_model_len")
            facts.max_input = Fact(
                mml - 1,
                "GET /v1/models data[0].max_model_len - 1",
                "vLLM rejects prompt + max_tokens > max_model_len",
            )
        else:
            facts.context_length = Fact.unknown("GET /v1/models data[0].max_model_len", "absent")
            facts.max_input = facts.context_length
        samples = ep.metrics()
        infos = samples_named(samples or [], CACHE_INFO)
        if samples is None:
            facts.pool_tokens = Fact.unknown(
                f"GET /metrics {CACHE_INFO}", "/metrics did not answer"
            )
        elif not infos:
            facts.pool_tokens = Fact.unknown(f"GET /metrics {CACHE_INFO}", "gauge absent")
        else:
            self._cache_facts(facts, [s.labels for s in infos])
        facts.cache_salt_supported = Fact(
            True, "vLLM OpenAI API (cache_salt, since 0.9)", "the prefix-sharing check verifies it"
        )
        facts.tokenizer = tokenizer_fact(client)
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
            found = samples_named(samples or [], name)
            if found:
                facts.counters[name] = Fact(
                    int(sum(s.value for s in found)), f"GET /metrics {name}"
                )
        return facts

    @staticmethod
    def _cache_facts(facts: TargetFacts, engines: list[dict[str, str]]) -> None:
        src = f"GET /metrics {CACHE_INFO}"
        per_engine: list[int] = []
        notes: list[str] = []
        block_size: int | None = None
        for labels in engines:
            blocks = _label_int(labels, "num_gpu_blocks")
            bs = _label_int(labels, "block_size")
            block_size = bs if bs is not None else block_size
            tokens = blocks * bs if blocks is not None and bs is not None else None
            declared = _label_int(labels, "kv_cache_size_tokens")
            if tokens is not None and declared is not None and declared != tokens:
                notes.append(
                    f"kv_cache_size_tokens={declared} != num_gpu_blocks×block_size={tokens}"
                )
                tokens = min(tokens, declared)  # never claim more than either source says
            elif tokens is None:
                tokens = declared
            if tokens is not None:
                per_engine.append(tokens)
        if block_size is not None:
            facts.page_size = Fact(block_size, f"{src} block_size")
        if per_engine:
            total = sum(per_engine)
            if len(per_engine) > 1:
                notes.append(
                    f"{len(per_engine)} data-parallel engines, {total} blocks×size in total; "
                    "one request runs on one engine, so the gate uses the smallest engine pool"
                )
                facts.extra["pool_tokens_all_engines"] = Fact(
                    total, f"{src} Σ num_gpu_blocks×block_size"
                )
            facts.pool_tokens = Fact(
                min(per_engine), f"{src} num_gpu_blocks×block_size", "; ".join(notes)
            )
        else:
            facts.pool_tokens = Fact.unknown(src, "labels lack num_gpu_blocks/block_size")
        epc = engines[0].get("enable_prefix_caching")
        if epc in ("True", "False", "true", "false"):
            facts.prefix_caching = Fact(epc.lower() == "true", f"{src} enable_prefix_caching")
