"""`kvfence serve --disaggregated` and `kvfence serve --role …`: option checks and dispatch.

Each role's spec is built here once from the options: a worker's `WorkerSpec` goes to its
process whole (serve/pd/spec.py), never back through argv.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvfence.faults import FaultSet
from kvfence.serve.pd.launch import run_disaggregated
from kvfence.serve.pd.spec import WorkerSpec
from kvfence.serve.tenants import TenantRegistry

if TYPE_CHECKING:
    from kvfence.serve.pd.router_role import RouterSpec

# The router's options, passed through to the router child of --disaggregated.
_ROUTER_SHARED = ("context_length", "scrub", "transport", "log_level")
_ROUTER_FLAGS = ("no_prefix_cache", "shared_prefix_cache", "allow_undersized_pool")
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
        return _disaggregated(params, faults, tenants, model_dir)
    if params["inbox"] is None:
        raise click.UsageError(f"--role {role} needs --inbox (this role's control address)")
    if role == "router":
        from kvfence.serve.pd.router_role import run_router  # the web stack: here only

        return run_router(router_spec(params, faults, model_dir), tenants, announce)
    if params["router_addr"] is None:
        raise click.UsageError(f"--role {role} needs --router-addr (the router's control address)")
    from kvfence.serve.pd.worker_entry import run_worker_process

    spec = worker_spec(params, faults, model_dir, role, params["inbox"], params["router_addr"])
    return run_worker_process(spec)


def _disaggregated(
    params: dict[str, Any], faults: FaultSet, tenants: TenantRegistry, model_dir: Path
) -> int:
    # Co-located workers share the cores: split them instead of oversubscribing.
    workers = params["n_prefill"] + params["n_decode"]
    threads = params["torch_threads"] or max(1, (os.cpu_count() or 1) // workers)

    def spec_for(role: str, inbox: str, router: str) -> WorkerSpec:
        return worker_spec(params, faults, model_dir, role, inbox, router, torch_threads=threads)

    return run_disaggregated(
        spec_for,
        n_prefill=params["n_prefill"],
        n_decode=params["n_decode"],
        host=params["host"],
        port=params["port"],
        tenants=tenants,
        router_args=_router_args(params, faults, model_dir),
    )


def _router_args(params: dict[str, Any], faults: FaultSet, model_dir: Path) -> list[str]:
    """The router child's options (the router is torch-free and re-reads its own options)."""
    args = ["--model", str(model_dir)]
    args += [x for n in _ROUTER_SHARED if params[n] is not None for x in (_flag(n), str(params[n]))]
    args += [_flag(n) for n in _ROUTER_FLAGS if params[n]]
    args += [x for n in _ROUTER_ONLY for x in (_flag(n), str(params[n]))]
    args += [x for f in faults.names() for x in ("--lab-fault", f)]
    if params["request_log"] is not None:
        args += ["--request-log", str(params["request_log"])]
    return args


def router_spec(params: dict[str, Any], faults: FaultSet, model_dir: Path) -> RouterSpec:
    if not params["prefill_addr"] or not params["decode_addr"]:
        raise click.UsageError(
            "--role router needs --prefill-addr and --decode-addr (at least one each)"
        )
    from kvfence.serve.pd.router_role import RouterSpec  # the web stack: the router only

    return RouterSpec(
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


def worker_spec(
    params: dict[str, Any],
    faults: FaultSet,
    model_dir: Path,
    role: str,
    inbox: str,
    router: str,
    torch_threads: int | None = None,
) -> WorkerSpec:
    """One worker's spec from the `serve` options; `torch_threads` overrides the option."""
    return WorkerSpec(
        role=role,
        model_dir=str(model_dir),
        model_kind=params["model_kind"],
        inbox=inbox,
        router=router,
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
        torch_threads=params["torch_threads"] if torch_threads is None else torch_threads,
    )
