"""Any OpenAI-compatible endpoint: content checks only.

Nothing in the OpenAI API says how large the KV pool is, so every capacity
fact is unknown and the gate is inconclusive — never a pass (fail closed).
"""

from __future__ import annotations

from typing import ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import Endpoints, Target, TargetFacts, json_int, models_fact

UNKNOWN = "the OpenAI API does not expose it"


class OpenAITarget(Target):
    engine: ClassVar[str] = "openai"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        models = endpoints.json("/v1/models")
        if models is not None and isinstance(models.get("data"), list):
            return "GET /v1/models answered an OpenAI model list (no engine-specific endpoint)"
        return None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        ep = Endpoints(client)
        model, entry = models_fact(ep)
        facts = TargetFacts(engine=Fact("openai", "GET /v1/models"), model=model)
        facts.pool_tokens = Fact.unknown("OpenAI API", UNKNOWN)
        mml, _ = json_int(entry, "max_model_len")
        facts.context_length = (
            Fact(mml, "GET /v1/models data[0].max_model_len")
            if mml is not None
            else Fact.unknown("OpenAI API", UNKNOWN)
        )
        facts.max_input = Fact.unknown("OpenAI API", "the exact length rule is engine-specific")
        facts.page_size = Fact.unknown("OpenAI API", UNKNOWN)
        facts.prefix_caching = Fact.unknown("OpenAI API", UNKNOWN)
        facts.cache_salt_supported = Fact.unknown("OpenAI API", UNKNOWN)
        facts.tokenizer = Fact("calibrated from usage.prompt_tokens", "OpenAI API")
        return facts
