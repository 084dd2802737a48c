"""kvfence's own server: `/server_info` (a public schema) and `/metrics`.

The audit reads kvfence like any other engine — over HTTP only — so a lab
server is recognised only by what it says (`lab.faults`), never by a backdoor.
Its `version` (in `/server_info`, as in `/version`) is recorded; the figures'
meaning is the `/server_info` schema itself, the same in every version.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import (
    Endpoints,
    Target,
    TargetFacts,
    json_int,
    metric_sum,
    models_fact,
    samples_named,
    tokenizer_fact,
    unanswered,
)
from kvfence.audit.targets.versions import version_fact

SERVER_INFO = "/server_info"
OPENAPI = "/openapi.json"
# Counters that must never move in production (I1, I3, transfers).
ISOLATION_COUNTERS = (
    "kvfence_isolation_violations_total",
    "kvfence_transfer_mismatches_total",
    "kvfence_transfer_failures_total",
)


class KvfenceTarget(Target):
    engine: ClassVar[str] = "kvfence"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        info = endpoints.json(SERVER_INFO)
        if info is not None and info.get("engine") == "kvfence":
            return 'GET /server_info answered {"engine": "kvfence"}'
        return None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        ep = Endpoints(client)
        info = ep.json(SERVER_INFO)
        model, _ = models_fact(ep)
        facts = TargetFacts(engine=Fact("kvfence", "GET /server_info engine"), model=model)
        if info is None:
            why = f"GET {SERVER_INFO} -> {ep.get(SERVER_INFO).status}"
            for name in ("pool_tokens", "context_length", "max_input", "page_size"):
                setattr(facts, name, Fact.unknown(SERVER_INFO, why))
            return facts
        if not model.known and isinstance(info.get("model"), str):
            facts.model = Fact(info["model"], "GET /server_info model")
        facts.extra["version"] = version_fact(info.get("version"), "GET /server_info version")
        _read_sizes(facts, info)
        _read_prefix_cache(facts, info)
        facts.tokenizer = tokenizer_fact(client)
        facts.vocab_size = _vocab(ep, info)
        for key in ("undersized_pool", "disaggregated", "transport", "scrub_policy", "auth"):
            v = info.get(key)
            if isinstance(v, bool | int | float | str):
                facts.extra[key] = Fact(v, f"GET /server_info {key}")
        _read_lab_and_gate(facts, info)
        facts.counters = self._counters(ep)
        return facts

    def read_counters(self, client: ProbeClient) -> dict[str, Fact]:
        return self._counters(Endpoints(client))

    def _counters(self, ep: Endpoints) -> dict[str, Fact]:
        samples = ep.metrics()
        why = unanswered(ep, "/metrics") if samples is None else ""
        out = {
            name: metric_sum(samples, name, f"GET /metrics {name}", why)
            for name in ISOLATION_COUNTERS
        }
        for s in samples_named(samples or [], "kvfence_requests_total"):
            outcome = s.labels.get("outcome", "?")
            out[f"kvfence_requests_total{{outcome={outcome}}}"] = Fact(
                int(s.value),
                "GET /metrics kvfence_requests_total",
                "outcome counter (informational)",
            )
        return out


def _num(info: dict[str, Any], key: str, note: str = "") -> Fact:
    v, _ = json_int(info, key)
    src = f"GET /server_info {key}"
    return Fact(v, src, note) if v is not None else Fact.unknown(src, "absent")


def _read_sizes(facts: TargetFacts, info: dict[str, Any]) -> None:
    facts.pool_tokens = _num(
        info, "max_total_num_tokens", "the smallest prefill KV pool, in tokens"
    )
    facts.context_length = _num(info, "context_length")
    edge, _ = json_int(info, "max_req_input_len")
    if edge is not None:
        # kvfence's edge rule is prompt + max_tokens <= max_req_input_len (I4).
        facts.max_input = Fact(
            edge - 1,
            "GET /server_info max_req_input_len - 1",
            "kvfence rejects prompt + max_tokens > max_req_input_len",
        )
    else:
        facts.max_input = Fact.unknown("GET /server_info max_req_input_len", "absent")
    facts.page_size = _num(info, "page_size")


def _vocab(ep: Endpoints, info: dict[str, Any]) -> Fact:
    """The vocabulary from /server_info when it says, else from the token-id bound the
    server's OpenAPI document states for a completion prompt (`maximum` = vocab - 1)."""
    stated, _ = json_int(info, "vocab_size")
    if stated is not None:
        return Fact(stated, "GET /server_info vocab_size")
    doc = ep.json(OPENAPI)
    src = f"GET {OPENAPI} /v1/completions prompt token id maximum + 1"
    if doc is None:
        return Fact.unknown(src, f"GET {OPENAPI} did not answer 200 with JSON")
    try:
        body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
        prompt = body["content"]["application/json"]["schema"]["properties"]["prompt"]
        forms = prompt["anyOf"]
    except (KeyError, TypeError):
        return Fact.unknown(src, "not stated")
    for form in forms if isinstance(forms, list) else []:
        items = form.get("items") if isinstance(form, dict) else None
        top, _ = json_int(items if isinstance(items, dict) else None, "maximum")
        if top is not None:
            return Fact(top + 1, src)
    return Fact.unknown(src, "no token-id bound in the schema")


def _read_prefix_cache(facts: TargetFacts, info: dict[str, Any]) -> None:
    pc = info.get("prefix_cache")
    if isinstance(pc, dict) and isinstance(pc.get("enabled"), bool):
        facts.prefix_caching = Fact(
            pc["enabled"],
            "GET /server_info prefix_cache.enabled",
            f"namespacing: {pc.get('namespacing')}",
        )
        if isinstance(pc.get("cache_salt"), bool):
            facts.cache_salt_supported = Fact(
                pc["cache_salt"], "GET /server_info prefix_cache.cache_salt"
            )


def _read_lab_and_gate(facts: TargetFacts, info: dict[str, Any]) -> None:
    lab = info.get("lab")
    if isinstance(lab, dict):
        faults = lab.get("faults") or []
        facts.extra["lab_faults"] = Fact(
            ",".join(str(f) for f in faults) if faults else "none",
            "GET /server_info lab.faults",
            "a non-empty list means a lab server with defences switched off",
        )
        if lab.get("profile") is not None:
            facts.extra["lab_profile"] = Fact(str(lab["profile"]), "GET /server_info lab.profile")
    gate = info.get("capacity_gate")
    if isinstance(gate, dict) and isinstance(gate.get("passed"), bool):
        facts.extra["engine_gate_passed"] = Fact(
            gate["passed"],
            "GET /server_info capacity_gate.passed",
            str(gate.get("message", "")),
        )
