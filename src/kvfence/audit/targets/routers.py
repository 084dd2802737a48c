"""Routers in front of a P/D fleet: `sglang-router` and `vllm-router`, audited through `fleet`.

Seen live (sglang-router 0.3.2, vllm-router 0.1.17, loopback, PD mode):

- sglang-router: `GET /get_server_info` answers only
  `{"router_manager": true, "routers_count": …, "workers_count": …}`;
  `/server_info` and `/metrics` are 404; `/v1/models` has no `max_model_len`;
  `/workers` lists every worker; `/engine_metrics` returns every worker's
  metrics renamed `:` → `_` with a `worker_addr` label.
- vllm-router: `/workers` likewise (no `metadata`); `GET /get_server_info`
  and `/v1/models` are passed to the first prefill worker — so without
  `/workers` it looks like one engine, the prefill worker it forwards to;
  other GETs (`/metrics`, `/server_info`) are 405; no engine metrics.

The fleet's facts: pool = the smallest prefill node's (unknown when any
prefill node is unreadable); limits = the smallest over every node (a request
goes to a prefill and a decode node, both check it); counters = every node's.
"""

from __future__ import annotations

from typing import ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.fleet import Fleet, parse_workers
from kvfence.audit.targets.base import (
    Endpoints,
    NodeFacts,
    Target,
    TargetFacts,
    models_fact,
    tokenizer_fact,
)
from kvfence.audit.targets.kvfence import KvfenceTarget
from kvfence.audit.targets.sglang import SglangTarget, is_router_info
from kvfence.audit.targets.vllm import VllmTarget

SALT_DROPPED = "cache_salt_dropped_on"  # read by the prefix-sharing check (prefix_salt_routes.py)


def _smallest(nodes: list[NodeFacts], name: str, which: str) -> Fact:
    facts = [(getattr(n, name), n.url) for n in nodes]
    unknown = [url for f, url in facts if not f.known]
    known = [(f.as_int(), url, f) for f, url in facts if f.as_int() is not None]
    if unknown or not known:
        return Fact.unknown(
            f"{name} of every {which} node", f"unreadable on {', '.join(unknown) or 'all'}"
        )
    n, url, fact = min(known, key=lambda t: t[0] or 0)
    return Fact(n, f"{fact.source} on {url} (smallest of {len(known)} {which} nodes)", fact.note)


class RouterTarget(Target):
    """A router URL: content checks go through it; facts come from every worker behind it."""

    worker_adapters: ClassVar[tuple[type[Target], ...]] = ()
    # What the router does with a request's cache_salt on its way to the workers.
    forwards_salt: ClassVar[str | None] = None
    # The routes on which the router drops cache_salt (comma-separated paths), if any.
    drops_salt_on: ClassVar[str | None] = None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        fleet = Fleet(client, self.worker_adapters)
        workers = fleet.workers()
        model, _ = models_fact(Endpoints(client))
        facts = TargetFacts(engine=Fact(self.engine, self.detected_by), model=model)
        if not workers:
            facts.pool_tokens = Fact.unknown("router GET /workers", "no workers listed")
            return facts
        routed = fleet.router_metrics() if self.engine == "sglang-router" else None
        facts.nodes = [fleet.read_node(w, routed) for w in workers]
        prefill = [n for n in facts.nodes if n.prefills]
        facts.pool_tokens = (
            _smallest(prefill, "pool_tokens", "prefill")
            if prefill
            else Fact.unknown("router GET /workers", "no prefill node behind the router")
        )
        known_ctx = [n for n in facts.nodes if n.context_length.known]
        facts.context_length = _smallest(known_ctx, "context_length", "reached")
        facts.max_input = _smallest(
            [n for n in facts.nodes if n.max_input.known], "max_input", "reached"
        )
        most = _most(facts.nodes, facts.max_input, facts.context_length)
        if most is not None:
            facts.extra["max_input_most"] = most
        facts.prefix_caching = _any_caches(facts.nodes)
        facts.cache_salt_supported = self._salt(facts.nodes)
        if self.drops_salt_on is not None:
            note = self.forwards_salt or ""
            facts.extra[SALT_DROPPED] = Fact(self.drops_salt_on, self.engine, note)
        facts.tokenizer = tokenizer_fact(client)
        facts.counters = {f"{n.url} {k}": v for n in facts.nodes for k, v in n.counters.items()}
        facts.extra["workers"] = Fact(
            len(workers),
            "router GET /workers",
            ", ".join(f"{w.origin} ({w.worker_type})" for w in workers),
        )
        return facts

    def _salt(self, nodes: list[NodeFacts]) -> Fact:
        salts = [n.extra.get("cache_salt_supported") for n in nodes]
        if self.forwards_salt is None:
            return Fact.unknown(self.engine, "not known to forward cache_salt to its workers")
        if all(f is not None and f.value is True for f in salts):
            return Fact(True, f"every worker; {self.engine}", self.forwards_salt)
        return Fact.unknown("worker cache_salt support", "not known on every worker")

    def read_counters(self, client: ProbeClient) -> dict[str, Fact]:
        facts = self.facts(client)
        fleet = Fleet(client, self.worker_adapters)
        return {f"{n.url} {k}": v for n in facts.nodes for k, v in fleet.read_counters(n).items()}


def _most(nodes: list[NodeFacts], limit: Fact, context: Fact) -> Fact | None:
    """The longest prompt any node may take: a reject probe must sit above every node's limit."""
    bounds: list[int] = []
    for n in nodes:
        own = n.extra.get("max_input_most") or n.max_input
        ctx = n.context_length if n.context_length.known else context
        bound = own.as_int() if own.known else None
        if bound is None and ctx.as_int() is not None:
            bound = (ctx.as_int() or 0) - 1  # the tokenizer's own rule: input <= context - 1
        if bound is None:
            return None
        bounds.append(bound)
    low = limit.as_int()
    if low is None or not bounds or max(bounds) <= low:
        return None
    return Fact(
        max(bounds),
        "every node's max_input (or context - 1)",
        f"nodes apply different limits ({low}..{max(bounds)}): the router may send a prompt "
        "in between to a node that legitimately takes it",
    )


def _any_caches(nodes: list[NodeFacts]) -> Fact:
    seen = [n.extra["prefix_caching"] for n in nodes if "prefix_caching" in n.extra]
    if any(f.value is True for f in seen):
        return Fact(True, "worker prefix caching (any node)")
    if seen and len(seen) == len(nodes) and all(f.value is False for f in seen):
        return Fact(False, "worker prefix caching (every node off)")
    return Fact.unknown("worker prefix caching", "not read on every node")


class SglangRouterTarget(RouterTarget):
    engine: ClassVar[str] = "sglang-router"
    # SGLang workers, or kvfence's (`kvfence serve --router sglang`, sglang_stack/).
    worker_adapters: ClassVar[tuple[type[Target], ...]] = (KvfenceTarget, SglangTarget)
    forwards_salt: ClassVar[str | None] = (
        "sglang-router 0.3.2 forwards cache_salt on /v1/completions (seen live); "
        "it drops it on /v1/chat/completions and /generate (seen live)"
    )
    drops_salt_on: ClassVar[str | None] = "/v1/chat/completions,/generate"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        if not is_router_info(endpoints.json("/get_server_info")):
            return None
        if parse_workers(endpoints.json("/workers")) is None:
            return None
        return 'GET /get_server_info has "router_manager" and GET /workers lists workers'


class VllmRouterTarget(RouterTarget):
    engine: ClassVar[str] = "vllm-router"
    worker_adapters: ClassVar[tuple[type[Target], ...]] = (VllmTarget, SglangTarget)

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        workers = parse_workers(endpoints.json("/workers"))
        if workers is None or is_router_info(endpoints.json("/get_server_info")):
            return None
        if any(w.mode is not None for w in workers):
            return None  # sglang-router's rows carry metadata.disaggregation_mode
        return "GET /workers lists workers with worker_type and no router_manager (vllm-router)"
