"""Hugging Face TGI (in maintenance mode since Dec 2025): `GET /info`, by version.

Read in TGI's `router/src/lib.rs` (`Info`) at each tag:

- 2.0.x: `max_input_length`, `max_total_tokens`, `max_batch_total_tokens`;
- 2.1–2.2: `max_input_tokens` (renamed), `max_total_tokens`, `max_batch_total_tokens`;
- 2.3+ / 3.x: no pool field (`max_input_tokens`, `max_total_tokens`, …).

`max_batch_total_tokens` is the paged pool for flash-attention models; for
other v2 models it is a batch budget, not a paged pool (said in the note).
From 2.3 the v3 backend refuses to start (`NotEnoughMemory`) unless its pool
holds `max_total_tokens`: a start-up guarantee of one full request, never of
headroom — so it is reported as `extra["pool_guarantee_tokens"]` and the
capacity gate decides from it only at headroom 1.0. The guarantee and the
pool field hold for the versions read (2.0 to 3.3); a version outside them,
or none stated, gives neither (the guarantee is a release's behaviour, not a
field the server shows). Length rule
(`validation.rs`): input <= max_input_tokens and input + max_new_tokens <=
max_total_tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import Endpoints, Target, TargetFacts, json_int, models_fact
from kvfence.audit.targets.versions import ReadRange, Version, parse_version, version_fact

NO_POOL_FIELD = (2, 3)  # from 2.3.0 /info carries no max_batch_total_tokens
READ = ReadRange("TGI", (2, 0), (3, 3))


def _version(info: dict[str, Any]) -> Version | None:
    return parse_version(info.get("version"))


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
        version = _version(info)
        total, _ = json_int(info, "max_total_tokens")
        if total is not None:
            facts.context_length = Fact(total, "GET /info max_total_tokens")
        facts.max_input = _max_input(info, total, version)
        stated = version_fact(info.get("version"), "GET /info version")
        facts.pool_tokens = _pool(info, version)
        unknown_rules = READ.unknown_rules(version, stated, "max_batch_total_tokens")
        if unknown_rules is not None:
            seen = f" (it states {facts.pool_tokens.value:,})" if facts.pool_tokens.known else ""
            facts.pool_tokens = Fact.unknown(
                f"{facts.pool_tokens.source}; {stated.source}",
                f"{unknown_rules}{seen}; nor is a start-up guarantee known for it",
            )
        elif total is not None and version is not None and version >= NO_POOL_FIELD:
            facts.extra["pool_guarantee_tokens"] = Fact(
                total,
                f"TGI {stated.value} v3 backend start-up (NotEnoughMemory below "
                "max_total_tokens; read in 2.3 to 3.3)",
                "the pool holds at least one full request; no headroom is promised",
            )
        facts.prefix_caching = Fact.unknown("GET /info", "not reported")
        facts.cache_salt_supported = Fact.unknown("TGI API", "not advertised")
        facts.tokenizer = Fact(
            "calibrated from usage.prompt_tokens", "TGI", "its /tokenize returns a different shape"
        )
        for key in ("version", "model_dtype", "model_device_type", "max_concurrent_requests"):
            v = info.get(key)
            if isinstance(v, str | int):
                facts.extra[key] = Fact(v, f"GET /info {key}")
        return facts


def _max_input(info: dict[str, Any], total: int | None, version: tuple[int, ...] | None) -> Fact:
    key = "max_input_length" if version is not None and version < (2, 1) else "max_input_tokens"
    mi, _ = json_int(info, key)
    if mi is None:
        return Fact.unknown(f"GET /info {key}", f"absent (TGI {info.get('version')} names it so)")
    if total is not None and total - 1 < mi:
        return Fact(total - 1, "GET /info max_total_tokens - 1", "input + max_new_tokens <= total")
    return Fact(mi, f"GET /info {key}", "TGI rejects input_length > it")


def _pool(info: dict[str, Any], version: tuple[int, ...] | None) -> Fact:
    pool, _ = json_int(info, "max_batch_total_tokens")
    src = "GET /info max_batch_total_tokens"
    if pool is None:
        return Fact.unknown(src, "absent (TGI >= 2.3 sizes the pool at warm-up and does not say)")
    device = info.get("model_device_type")
    return Fact(
        pool,
        src,
        f"the paged KV pool for flash-attention models; a batch budget otherwise "
        f"(device {device}, version {info.get('version')})",
    )
