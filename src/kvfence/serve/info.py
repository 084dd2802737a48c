"""`/server_info`: the live capacity facts the audit kit reads (schema is a public contract).

Values come from the running backend (pool sizes and usage) and the start-up
capacity decision, never from a config file (INCIDENT.md runbook signal 1).
Every active lab fault is listed so an audit can never mistake a lab server
for production.

The full document is operator data. A tenant key gets `tenant_view`: the
static capacity facts (what a deploy gate and a client need), its own live
requests, and neither the pools' live usage nor the lab facts (I10: one
tenant never observes another's activity).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvfence import __version__
from kvfence.engine.backend import BackendStats
from kvfence.serve.config import Capacity, ServeConfig

ENGINE_NAME = "kvfence"


def server_info(
    config: ServeConfig,
    capacity: Capacity,
    stats: BackendStats,
    auth: str,
    admission: dict[str, Any] | None = None,
) -> dict[str, Any]:
    report = capacity.report
    pools = [asdict(p) for p in stats.pools]
    page_size = stats.pools[0].page_size if stats.pools else None
    return {
        "engine": ENGINE_NAME,
        "version": __version__,
        "model": config.model_name,
        "context_length": config.context_length,
        "max_model_len": config.context_length,
        "max_req_input_len": capacity.edge_limit,
        "max_total_num_tokens": capacity.max_total_num_tokens,
        "page_size": page_size,
        "scrub_policy": config.scrub.value,
        "pools": pools,
        "capacity_gate": {
            "passed": report.passed,
            "skipped": capacity.gate_skipped,
            "pool_tokens": report.pool_tokens,
            "context_length": report.context_length,
            "headroom": report.headroom,
            "required_tokens": report.required_tokens,
            "margin_tokens": report.margin_tokens,
            "message": report.message(),
        },
        "undersized_pool": not report.passed,
        "disaggregated": config.disaggregated,
        "transport": config.transport,
        "prefix_cache": {
            "enabled": config.prefix_cache,
            "namespacing": config.prefix_namespacing,
            "cache_salt": True,
        },
        "auth": auth,
        "lab": {"faults": config.faults.names(), "profile": config.lab_profile},
        # The caller's own tenant limits and live usage (serve/limits.py); never another's.
        "admission": admission,
    }


OPERATOR_ONLY = ("lab",)
LIVE_POOL_FIELDS = ("pages_used", "pages_free", "pages_pending", "pages_cached")


def tenant_view(full: dict[str, Any], tenant: str, live_requests: int) -> dict[str, Any]:
    """What a tenant key reads: the full document less live usage and lab facts, plus its own."""
    view = {k: v for k, v in full.items() if k not in OPERATOR_ONLY}
    view["pools"] = [
        {k: v for k, v in p.items() if k not in LIVE_POOL_FIELDS} for p in full["pools"]
    ]
    view["usage"] = {"tenant": tenant, "live_requests": live_requests}
    view["operator_data"] = "omitted: pool usage and lab facts need an operator key"
    return view
