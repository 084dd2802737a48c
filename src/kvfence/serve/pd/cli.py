"""`kvfence serve --disaggregated` and `kvfence serve --role …`: option checks and dispatch."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvfence.faults import FaultSet
from kvfence.serve.pd.launch import run_disaggregated
from kvfence.serve.tenants import TenantRegistry

# Options every role must agree on, passed through to each child of --disaggregated.
_SHARED = (
    "model_kind",
    "context_length",
    "kv_pages",
    "kv_bytes",
    "kv_memory_fraction",
    "page_size",
    "scrub",
    "transport",
    "log_level",
)
_SHARED_FLAGS = ("no_prefix_cache", "shared_prefix_cache")
_ROUTER_ONLY = ("headroom", "default_max_tokens")


def _per_role(value: str | None, role: str) -> int | None:
    from kvfence.serve.cli import parse_per_role  # late: serve.cli imports this module

    prefill, decode = parse_per_role(value, f"--kv-* ({role})")
    return prefill if role == "prefill" else decode


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def pd_main(
    params: dict[str, Any],
    faults: FaultSet,
    tenants: TenantRegistry,
    model_dir: Path,
    announce: Callable[..., None],
) -> int:
    role = params["role"]
    if params["pd_router"] == "sglang":
        from kvfence.serve.sglang.cli import sglang_main

        return sglang_main(params, faults, tenants, model_dir)
    if params["disaggregated"]:
        if role is not None:
            raise click.UsageError("--disaggregated starts every role; --role runs one of them")
        args: list[str] = ["--model", str(model_dir)]
        for name in _SHARED:
            if params[name] is not None:
                args += [_flag(name), str(params[name])]
        args += [_flag(n) for n in _SHARED_FLAGS if params[n]]
        # Co-located workers share the cores: split them instead of oversubscribing.
        workers = params["n_prefill"] + params["n_decode"]
        threads = params["torch_threads"] or max(1, (os.cpu_count() or 1) // workers)
        args += ["--torch-threads", str(threads)]
        for f in faults.names():
            args += ["--lab-fault", f]
        router_args = [x for n in _ROUTER_ONLY for x in (_flag(n), str(params[n]))]
        if params["allow_undersized_pool"]:
            router_args.append("--allow-undersized-pool")
        if params["request_log"] is not None:
            router_args += ["--request-log", str(params["request_log"])]
        return run_disaggregated(
            args,
            n_prefill=params["n_prefill"],
            n_decode=params["n_decode"],
            host=params["host"],
            port=params["port"],
            tenants=tenants,
            router_args=router_args,
        )
    if params["inbox"] is None:
        raise click.UsageError(f"--role {role} needs --inbox (this role's control address)")
    if role == "router":
        if not params["prefill_addr"] or not params["decode_addr"]:
            raise click.UsageError(
                "--role router needs --prefill-addr and --decode-addr (at least one each)"
            )
        from kvfence.serve.pd.router_role import RouterSpec, run_router  # the web stack: here only

        spec = RouterSpec(
            model_dir=str(model_dir),
            inbox=params["inbox"],
            prefill=tuple(params["prefill_addr"]),
            decode=tuple(params["decode_addr"]),
            host=params["host"],
            port=params["port"],
            transport=params["transport"],
            context_length=params["context_length"],
            headroom=params["headroom"],
            allow_undersized_pool=params["allow_undersized_pool"],
            faults=tuple(faults.names()),
            default_max_tokens=params["default_max_tokens"],
            scrub_policy=params["scrub"],
            prefix_cache=not params["no_prefix_cache"],
            shared_prefix_cache=params["shared_prefix_cache"],
            log_level=params["log_level"],
            request_log=params["request_log"],
        )
        return run_router(spec, tenants, announce)
    if params["router_addr"] is None:
        raise click.UsageError(f"--role {role} needs --router-addr (the router's control address)")
    from kvfence.serve.pd.workers import WorkerSpec, run_worker  # torch: workers only

    worker = WorkerSpec(
        role=role,
        model_dir=str(model_dir),
        model_kind=params["model_kind"],
        inbox=params["inbox"],
        router=params["router_addr"],
        pages=_per_role(params["kv_pages"], role),
        kv_bytes=_per_role(params["kv_bytes"], role),
        kv_memory_fraction=params["kv_memory_fraction"],
        page_size=params["page_size"],
        context_length=params["context_length"],
        scrub=params["scrub"],
        prefix_cache=not params["no_prefix_cache"],
        shared_prefix_namespace="shared" if params["shared_prefix_cache"] else None,
        faults=tuple(faults.names()),
        transport=params["transport"],
        kv_host=params["kv_host"],
    )
    rc = run_worker(worker)  # sockets closed, shared memory unlinked, engines stopped
    # Skip interpreter finalisation: it took 7-20 s in workers holding torch and zmq state,
    # which made every supervised shutdown wait (nothing is left to flush but stdio).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
