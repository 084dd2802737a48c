"""Hugging Face TGI: `GET /info`.

`/info` carries `model_id`, `max_input_tokens` (older: `max_input_length`),
`max_total_tokens` (prompt + new tokens per request) and, on older releases,
`max_batch_total_tokens` (the token budget of a whole batch — the KV pool).
Newer releases derive that budget at warm-up and do not return it: then the
pool is unknown and the gate is inconclusive.
"""

from __future__ import annotations

from typing import ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import Endpoints, Target, TargetFacts, json_int, models_fact


class TgiTarget(Target):
    engine: ClassVar[str] = "tgi"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        info = endpoints.json("/info")
        if info is not None and "model_id" in info and "max_total_tokens" in info:
            return "GET /info has model_id and max_total_tokens (TGI)"
        return None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        ep = Endpoints(client)
        info = ep.json("/info")
        model, _ = models_fact(ep)
        facts = TargetFacts(engine=Fact("tgi", "GET /info"), model=model)
        if info is None:
            facts.pool_tokens = Fact.unknown("GET /info", "did not answer")
            return facts
        if not model.known and isinstance(info.get("model_id"), str):
            facts.model = Fact(info["model_id"], "GET /info model_id")
        total, _ = json_int(info, "max_total_tokens")
        if total is not None:
            facts.context_length = Fact(total, "GET /info max_total_tokens")
        mi, key = json_int(info, "max_input_tokens", "max_input_length")
        if mi is not None:
            facts.max_input = Fact(mi, f"GET /info {key}")
        pool, _ = json_int(info, "max_batch_total_tokens")
        facts.pool_tokens = (
            Fact(pool, "GET /info max_batch_total_tokens")
            if pool is not None
            else Fact.unknown(
                "GET /info max_batch_total_tokens", "absent (newer TGI derives it at warm-up)"
            )
        )
        facts.prefix_caching = Fact.unknown("GET /info", "not reported")
        facts.cache_salt_supported = Fact.unknown("TGI API", "not advertised")
        facts.tokenizer = Fact(
            "calibrated from usage.prompt_tokens", "TGI", "its /tokenize returns a different shape"
        )
        for key in ("version", "model_dtype", "max_concurrent_requests"):
            v = info.get(key)
            if isinstance(v, str | int):
                facts.extra[key] = Fact(v, f"GET /info {key}")
        return facts
