"""`kvfence serve --disaggregated` and `kvfence serve --role …`: option checks and dispatch.

`--disaggregated` starts the real PD stack (sglang-router, serve/sglang/) unless `--router
kvfence` asks for kvfence's own hub (serve/pd/: what it still does is in the README).

Each role's spec is built here once from the options, by the same function whether the role
runs in this process (`--role`) or as a child of `--disaggregated`: a `WorkerSpec` or the
`RouterSpec` goes to its process whole (serve/pd/spec.py), never back through argv.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvfence.faults import FaultSet
from kvfence.serve.pd.launch import Loopback, run_disaggregated
from kvfence.serve.pd.spec import RouterSpec, WorkerSpec
from kvfence.serve.startup import collector_paused
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.worker_options import worker_spec


def pd_main(
    params: dict[str, Any],
    faults: FaultSet,
    tenants: TenantRegistry,
    model_dir: Path,
    announce: Callable[[str, TenantRegistry, str, str], None],
) -> int:
    role = params["role"]
    if router_of(params) == "sglang":
        check_real_stack_options(params)
        from kvfence.serve.sglang.cli import sglang_main

        return sglang_main(params, faults, tenants, model_dir)
    if params["disaggregated"]:
        if role is not None:
            raise click.UsageError("--disaggregated starts every role; --role runs one of them")
        return _disaggregated(params, faults, tenants, model_dir)
    if params["inbox"] is None:
        raise click.UsageError(f"--role {role} needs --inbox (this role's control address)")
    if role == "router":
        router = _operator_router_spec(params, faults, model_dir)
        with collector_paused():  # start-up imports (serve/startup.py)
            from kvfence.serve.pd.router_role import run_router  # the web stack: past validation

        return run_router(router, tenants, announce)
    if params["router_addr"] is None:
        raise click.UsageError(f"--role {role} needs --router-addr (the router's control address)")
    from kvfence.serve.pd.worker_entry import run_worker_process

    spec = worker_spec(params, faults, model_dir, role, params["inbox"], params["router_addr"])
    return run_worker_process(spec)


def router_of(params: dict[str, Any]) -> str:
    """`--router`, or its default: sglang-router for `--disaggregated` (the real PD stack),
    kvfence's own hub for `--role` (multi-host as before; `--role router` is the hub)."""
    chosen: str | None = params["pd_router"]
    return chosen or ("sglang" if params["disaggregated"] else "kvfence")


def check_real_stack_options(params: dict[str, Any]) -> None:
    """A usage error (exit 2) for an option the sglang-router stack would drop silently, and
    when the router is not installed; the fix is `--router kvfence` (README)."""
    given = ["--request-log (written by kvfence's own router)"] if params["request_log"] else []
    if params["no_auth"] and params["disaggregated"]:
        given.append("--no-auth (a keyless dev tenant cannot be handed to the stack's workers)")
    if given:
        raise click.UsageError(
            f"not with sglang-router: {'; '.join(given)}. Use --router kvfence for these"
        )
    if importlib.util.find_spec("sglang_router") is None:
        raise click.UsageError(
            "sglang-router is not installed (pip install 'kvfence[pd]'); "
            "or use kvfence's own router: --router kvfence"
        )


def _disaggregated(
    params: dict[str, Any], faults: FaultSet, tenants: TenantRegistry, model_dir: Path
) -> int:
    # Co-located workers share the cores: split them instead of oversubscribing.
    workers = params["n_prefill"] + params["n_decode"]
    threads = params["torch_threads"] or max(1, (os.cpu_count() or 1) // workers)

    def spec_for(role: str, inbox: str, router: str) -> WorkerSpec:
        return worker_spec(params, faults, model_dir, role, inbox, router, torch_threads=threads)

    def router_for(addrs: Loopback) -> RouterSpec:
        return router_spec(params, faults, model_dir, addrs.router, addrs.prefill, addrs.decode)

    return run_disaggregated(
        spec_for,
        router_for,
        n_prefill=params["n_prefill"],
        n_decode=params["n_decode"],
        tenants=tenants,
    )


def _operator_router_spec(params: dict[str, Any], faults: FaultSet, model_dir: Path) -> RouterSpec:
    """`--role router`: the workers' addresses come from the options."""
    if not params["prefill_addr"] or not params["decode_addr"]:
        raise click.UsageError(
            "--role router needs --prefill-addr and --decode-addr (at least one each)"
        )
    inbox, prefill, decode = params["inbox"], params["prefill_addr"], params["decode_addr"]
    return router_spec(params, faults, model_dir, inbox, tuple(prefill), tuple(decode))


def router_spec(
    params: dict[str, Any],
    faults: FaultSet,
    model_dir: Path,
    inbox: str,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
) -> RouterSpec:
    """The router's spec from the `serve` options and the workers' control addresses; a bad
    option is a usage error (exit 2) before any process starts or anything binds."""
    tenants_file, log = params["tenants_file"], params["request_log"]
    try:
        return RouterSpec(
            model_dir=str(model_dir),
            inbox=inbox,
            prefill=prefill,
            decode=decode,
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
            request_log=None if log is None else str(log),
            tenants_file=None if tenants_file is None else str(tenants_file),
            no_auth=params["no_auth"],
        )
    except ValueError as e:
        raise click.UsageError(f"bad router options: {e}") from None
