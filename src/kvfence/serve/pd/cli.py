"""`kvfence serve --disaggregated` and `kvfence serve --role …`: dispatch to the PD topology.

`--disaggregated` starts the real PD stack (sglang-router, serve/sglang/) unless `--router
kvfence` asks for kvfence's own hub (serve/pd/: what it still does is in the README).

Each role's spec is derived once from the parsed options (serve/options.py), by the same
method whether the role runs in this process (`--role`) or as a child of `--disaggregated`:
a `WorkerSpec` or the `RouterSpec` goes to its process whole (serve/specs.py), never back
through argv.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import click

from kvfence.serve.options import PDRouter, Role, ServeOptions
from kvfence.serve.pd.launch import Loopback, run_disaggregated
from kvfence.serve.specs import RouterSpec, WorkerSpec
from kvfence.serve.startup import collector_paused
from kvfence.serve.tenants import TenantRegistry


def pd_main(
    options: ServeOptions,
    tenants: TenantRegistry,
    announce: Callable[[str, TenantRegistry, str, str], None],
) -> int:
    """Run the topology the options name; ServeOptions has checked which flags it needs."""
    if options.pd_router is PDRouter.SGLANG:
        check_sglang_router_installed()
        from kvfence.serve.sglang.cli import sglang_main

        return sglang_main(options, tenants)
    if options.disaggregated:
        return _disaggregated(options, tenants)
    assert options.role is not None and options.inbox is not None  # pd_router is None otherwise
    if options.role is Role.ROUTER:
        router = options.router_spec(options.inbox, options.prefill_addr, options.decode_addr)
        with collector_paused():  # start-up imports (serve/startup.py)
            from kvfence.serve.pd.router_role import run_router  # the web stack: past validation

        return run_router(router, tenants, announce)
    from kvfence.serve.pd.worker_entry import run_worker_process

    assert options.router_addr is not None
    return run_worker_process(options.worker_spec(options.role, options.inbox, options.router_addr))


def check_sglang_router_installed() -> None:
    """A usage error (exit 2) naming the extra, and the fix that needs none."""
    if importlib.util.find_spec("sglang_router") is None:
        raise click.UsageError(
            "sglang-router is not installed (pip install 'kvfence[pd]'); "
            "or use kvfence's own router: --router kvfence"
        )


def _disaggregated(options: ServeOptions, tenants: TenantRegistry) -> int:
    threads = options.worker_threads

    def spec_for(role: str, inbox: str, router: str) -> WorkerSpec:
        return options.worker_spec(Role(role), inbox, router, torch_threads=threads)

    def router_for(addrs: Loopback) -> RouterSpec:
        return options.router_spec(addrs.router, addrs.prefill, addrs.decode)

    return run_disaggregated(
        spec_for,
        router_for,
        n_prefill=options.n_prefill,
        n_decode=options.n_decode,
        tenants=tenants,
    )
