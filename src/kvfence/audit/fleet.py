"""A P/D fleet behind its router, read node by node.

A router (sglang-router, vllm-router) lists its workers at `GET /workers`
(`url`, `worker_type` prefill | decode | regular, `bootstrap_port`, and on
sglang-router `metadata.disaggregation_mode`). The reject path of the
incident fires on a *prefill* node's pool, and transfer failures count on
*decode* nodes, so one engine's facts never speak for the fleet:

- every worker is read through its own endpoints (its adapter) where it
  answers; otherwise, on sglang-router, from the router's `/engine_metrics`
  (every worker's metrics, `:` renamed `_`, labelled `worker_addr`);
- the fleet's pool is the smallest *prefill* pool, unknown when any prefill
  node cannot be read (fail closed: an unread node may be the short one);
- counters come from every node, decode included, keyed by node URL;
- content checks go through the router URL (what a client sees).

A worker's URL as the router lists it can carry the router's credential in
its path (kvfence workers behind sglang-router: `/r/<secret>`), so a node is
shown by its origin only (`NodeFacts.url`); the full URL (`endpoint`) is used
to reach it and never reported. Node reads send no tenant key: the operator
key where given (its /server_info and /metrics are operator data), else no
key at all (what the worker tells its router). Only a count that needs a
tenant's `/tokenize` (checks/canary/probe_length.py) sends a key to a worker, tenant B's.

HTTP only, through clients charged to the audit's budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import (
    Endpoints,
    NodeFacts,
    Sample,
    Target,
    TargetFacts,
    json_int,
    parse_prometheus,
)

ROLE_OF_TYPE = {"prefill": "prefill", "decode": "decode", "regular": "unified"}


@dataclass(frozen=True, slots=True)
class Worker:
    """One row of a router's `GET /workers`."""

    url: str
    worker_type: str
    bootstrap_port: int | None
    mode: str | None  # sglang-router: metadata.disaggregation_mode as the worker reported it

    @property
    def origin(self) -> str:
        return origin(self.url)


def origin(url: str) -> str:
    """scheme://host:port only: a worker URL's path can be a router's credential."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{parts.port}" if parts.port else f"{parts.scheme}://{host}"


def parse_workers(obj: Any) -> list[Worker] | None:
    """The workers of a `/workers` answer, or None when it is not a router's shape."""
    rows = obj.get("workers") if isinstance(obj, dict) else None
    if not isinstance(rows, list) or not rows:
        return None
    out = []
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("url"), str):
            return None
        wtype = row.get("worker_type")
        meta = row.get("metadata")
        mode = meta.get("disaggregation_mode") if isinstance(meta, dict) else None
        port, _ = json_int(row, "bootstrap_port")
        out.append(
            Worker(
                url=row["url"].rstrip("/"),
                worker_type=wtype if isinstance(wtype, str) else "unknown",
                bootstrap_port=port,
                mode=mode if isinstance(mode, str) else None,
            )
        )
    return out


def sibling(client: ProbeClient, url: str, *, tenant_key: bool = True) -> ProbeClient:
    """A client for another node, same budget (every GET is charged); the tenant's key only
    with `tenant_key` (a node read sends the operator key, or none)."""
    return ProbeClient(
        url,
        api_key=client.api_key if tenant_key else None,
        budget=client.budget,
        timeout_s=client.timeout_s,
        operator_key=client.operator_key,
    )


def engine_metrics_of(samples: list[Sample] | None, url: str) -> list[Sample] | None:
    """One worker's samples from a router's `/engine_metrics`, names back to `engine:metric`."""
    if samples is None:
        return None
    mine = [s for s in samples if s.labels.get("worker_addr", "").rstrip("/") == url]
    if not mine:
        return None
    return [Sample(_unrename(s.name), s.labels, s.value) for s in mine]


def _unrename(name: str) -> str:
    for engine in ("sglang", "vllm"):
        if name.startswith(f"{engine}_"):
            return f"{engine}:{name[len(engine) + 1 :]}"
    return name


def _role(worker: Worker, own: Fact | None) -> Fact:
    """The worker's own live role where it says one; the router's word otherwise.

    A disagreement (the node switched role, or the router is stale) is "mixed":
    such a node is gated like a prefill node (fail closed).
    """
    routed = ROLE_OF_TYPE.get(worker.worker_type)
    src = f"router GET /workers worker_type={worker.worker_type}"
    if own is None or not own.known:
        return Fact(routed, src) if routed else Fact.unknown(src, "unknown worker type")
    if routed is not None and routed != own.value and routed != "unified":
        return Fact("mixed", f"{own.source}; {src}", f"node says {own.value}, router {routed}")
    return Fact(own.value, own.source, f"router: {worker.worker_type}")


class Fleet:
    """Reads every worker behind one router (`adapters`: the worker engines to try)."""

    def __init__(self, client: ProbeClient, adapters: Sequence[type[Target]]) -> None:
        self.client = client
        self.adapters = tuple(adapters)
        self.ep = Endpoints(client)

    def workers(self) -> list[Worker] | None:
        return parse_workers(self.ep.json("/workers"))

    def router_metrics(self) -> list[Sample] | None:
        r = self.client.get("/engine_metrics", timeout_s=30.0)
        return parse_prometheus(r.body) if r.ok and r.body.strip() else None

    def read_node(self, worker: Worker, routed: list[Sample] | None) -> NodeFacts:
        """One node: its own adapter where it answers, else the router's engine metrics."""
        c = sibling(self.client, worker.url, tenant_key=False)
        try:
            ep = Endpoints(c)
            cls = next((a for a in self.adapters if a.identify(ep) is not None), None)
            if cls is not None:
                facts = cls(worker.origin, detected_by=f"router /workers; {cls.engine}").read_facts(
                    c
                )
                return _node_from(worker, facts)
        except Exception as e:  # a node that cannot be read is reported, never assumed
            note = f"{type(e).__name__}: {e}"
        else:
            note = "the node's own endpoints were not recognised"
        finally:
            c.close()
        return self._via_router(worker, routed, note)

    def _via_router(self, worker: Worker, routed: list[Sample] | None, why: str) -> NodeFacts:
        mine = engine_metrics_of(routed, worker.url)
        src = "router GET /engine_metrics"
        pools = [s.value for s in mine or [] if s.name == "sglang:max_total_num_tokens"]
        pool = (
            Fact(int(min(pools)), f"{src} sglang_max_total_num_tokens{{worker_addr}} (min)", why)
            if pools
            else Fact.unknown(f"GET {worker.origin}/server_info; {src}", f"unreadable: {why}")
        )
        types = {s.labels["engine_type"] for s in mine or [] if "engine_type" in s.labels}
        own = Fact(types.pop(), f"{src} engine_type label") if len(types) == 1 else None
        node = NodeFacts(
            url=worker.origin, role=_role(worker, own), pool_tokens=pool, endpoint=worker.url
        )
        node.counters = self.counters_via_router(worker.origin, mine)
        return node

    def counters_via_router(self, url: str, mine: list[Sample] | None) -> dict[str, Fact]:
        from kvfence.audit.targets.sglang import PD_COUNTERS  # the worker engine's names

        out: dict[str, Fact] = {}
        for name in PD_COUNTERS:
            found = [s.value for s in mine or [] if s.name == name]
            out[name] = (
                Fact(int(sum(found)), f"router GET /engine_metrics {name}{{worker_addr}}")
                if found
                else Fact.unknown(f"router GET /engine_metrics worker_addr={url}", "absent")
            )
        return out

    def read_counters(self, node: NodeFacts) -> dict[str, Fact]:
        """A node's failure counters now (its own /metrics, else the router's)."""
        endpoint = node.endpoint or node.url
        if node.reached:
            c = sibling(self.client, endpoint, tenant_key=False)
            try:
                ep = Endpoints(c)
                cls = next((a for a in self.adapters if a.identify(ep) is not None), None)
                if cls is not None:
                    return cls(node.url).read_counters(c)
            finally:
                c.close()
        return self.counters_via_router(
            node.url, engine_metrics_of(self.router_metrics(), endpoint)
        )


def _node_from(worker: Worker, facts: TargetFacts) -> NodeFacts:
    node = NodeFacts(
        url=worker.origin,
        endpoint=worker.url,
        role=_role(worker, facts.extra.get("pd_role")),
        pool_tokens=facts.pool_tokens,
        context_length=facts.context_length,
        max_input=facts.max_input,
        counters=dict(facts.counters),
        reached=True,
    )
    node.extra = {k: v for k, v in facts.extra.items() if k != "pd_role"}
    node.extra["prefix_caching"] = facts.prefix_caching
    node.extra["page_size"] = facts.page_size
    node.extra["cache_salt_supported"] = facts.cache_salt_supported
    node.extra["engine"] = facts.engine
    return node
