"""`/server_info`: the live capacity facts the audit kit reads (schema is a public contract).

Values come from the running backend (pool sizes and usage) and the start-up
capacity decision, never from a config file (INCIDENT.md runbook signal 1).
Every active lab fault is listed so an audit can never mistake a lab server
for production.
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
        "scrub_policy": config.scrub_policy,
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
