"""One kvfence prefill or decode worker behind SGLang's router: build it, gate it, serve it.

The worker is kvfence's own HTTP server (auth, strict fields, limits, the
capacity gate on its live pool, I4) over one half of the pair (`PrefillSide`
or `DecodeSide`), behind `RouterGate`, which admits the router by its path
credential. Its first stdout line after start-up is `ANNOUNCE` + JSON (role,
URL, bootstrap port) so a launcher can hand the router the ports it bound.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.types import ASGIApp

from kvfence.engine.decode import DecodeEngine
from kvfence.engine.prefill import PrefillEngine
from kvfence.faults import FaultSet
from kvfence.kv.pool import KVPool
from kvfence.kv.scrub import ScrubPolicy
from kvfence.model.loader import LoadedModel, load_model
from kvfence.serve.config import Capacity, ServeConfig
from kvfence.serve.serving import Listen, Server, run_server
from kvfence.serve.specs import SglangWorkerSpec, engine_config
from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.cores import from_environment
from kvfence.sglang_stack.decode import DecodeSide
from kvfence.sglang_stack.gate import RouterGate
from kvfence.sglang_stack.generate import add_generate_route
from kvfence.sglang_stack.prefill import PrefillSide
from kvfence.sglang_stack.routing import WorkerRouter
from kvfence.sglang_stack.side import PairSide
from kvfence.transfer.lab_holds import LabHold
from kvfence.transfer.registry import get_transport

ANNOUNCE = "KVFENCE_SGLANG_WORKER "


def build_side(spec: SglangWorkerSpec, loaded: LoadedModel) -> PairSide:
    w = spec.worker
    faults = FaultSet.parse(w.faults)
    config = engine_config(w, loaded)
    geometry = loaded.config.kv_geometry(page_size=w.page_size)
    if w.role == "prefill":
        pool = KVPool(geometry, config.prefill_pages, scrub=config.scrub, faults=faults)
        engine = PrefillEngine(loaded.model, pool, config, faults)
        addr = f"tcp://{spec.host}:{spec.bootstrap_port}"
        return PrefillSide(
            engine,
            get_transport(w.transport),
            addr,
            LabHold.of(faults),
            pair_timeout_s=spec.pair_timeout,
        )
    transport = get_transport(w.transport, host=w.kv_host)
    pool = transport.create_pool(geometry, config.decode_pages, scrub=config.scrub, faults=faults)
    receiver = transport.receiver(pool)
    decode = DecodeEngine(loaded.model, pool, config, faults, inbound=receiver)
    reply_addr = f"tcp://{w.kv_host}:0"
    hold = LabHold.of(faults)
    return DecodeSide(decode, receiver, reply_addr, faults, hold, pair_timeout_s=spec.pair_timeout)


def serve_config(spec: SglangWorkerSpec, loaded: LoadedModel) -> ServeConfig:
    w = spec.worker
    return ServeConfig(
        model_name=Path(w.model_dir).name,
        context_length=w.context_length or loaded.config.max_position_embeddings,
        vocab_size=loaded.config.vocab_size,
        headroom=spec.headroom,
        allow_undersized_pool=spec.allow_undersized_pool,
        faults=FaultSet.parse(w.faults),
        default_max_tokens=spec.default_max_tokens,
        scrub=ScrubPolicy(w.scrub),
        transport=w.transport,
        disaggregated=True,
        prefix_cache=w.prefix_cache,
        shared_prefix_cache=w.shared_prefix_cache,
    )


def router_facts(
    spec: SglangWorkerSpec, side: PairSide, config: ServeConfig, capacity: Capacity
) -> dict[str, Any]:
    """What sglang-router reads at registration, in SGLang's field names, plus the live pool.

    Also what a fleet audit needs without any key (limits, prefix-cache policy): it reads
    here on the router's path rather than sending a tenant's key to a worker.
    """
    pool = side.stats().pools[0]
    w = spec.worker
    return {
        "model_path": w.model_dir,  # the router loads its tokenizer from here (offline)
        "tokenizer_path": w.model_dir,
        "served_model_name": config.model_name,
        "is_generation": True,
        "disaggregation_mode": w.role,
        "disaggregation_bootstrap_port": side.inbox.addr.rsplit(":", 1)[1]
        if w.role == "prefill"
        else None,
        "disaggregation_transfer_backend": w.transport,
        "context_length": config.context_length,
        "max_total_num_tokens": pool.pool_tokens,
        "max_req_input_len": capacity.edge_limit,
        "prefix_cache": {
            "enabled": config.prefix_cache,
            "namespacing": config.prefix_namespacing,
            "cache_salt": True,
        },
        "page_size": pool.page_size,
        "pages_used": pool.pages_used,
        "pages_free": pool.pages_free,
        "pages_pending": pool.pages_pending,
        "integrity": side.integrity,
        "engine": "kvfence",
    }


def run_sglang_worker(spec: SglangWorkerSpec, tenants: TenantRegistry) -> int:
    """Serve until SIGTERM; exit 1 when the live pool fails the capacity gate (I4)."""
    loaded = load_model(spec.worker.model_dir, kind=spec.worker.model_kind)
    side = build_side(spec, loaded)
    side.core_share = from_environment(torch.set_num_threads)  # the stack's co-located workers
    config = serve_config(spec, loaded)
    server = Server(side, loaded.tokenizer, config, tenants, router_type=WorkerRouter)

    def expose(app: Starlette, capacity: Capacity) -> ASGIApp:
        add_generate_route(app)  # SGLang's native route, on the same admission path
        return RouterGate(app, spec.secret, lambda: router_facts(spec, side, config, capacity))

    def listening(url: str, capacity: Capacity) -> None:
        port = side.inbox.addr.rsplit(":", 1)[1]
        bootstrap = int(port) if spec.worker.role == "prefill" else None
        shown = {"role": spec.worker.role, "url": url, "bootstrap_port": bootstrap}
        print(ANNOUNCE + json.dumps(shown), flush=True)
        print(capacity.report.message(), file=sys.stderr, flush=True)

    listen = Listen(spec.host, spec.port, spec.log_level)
    return run_server(server, listen, listening, expose=expose)
