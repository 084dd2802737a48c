"""`kvfence serve --router kvfence …`: kvfence's own hub, on one host or one role per host.

`--disaggregated` starts the router and the workers as supervised children on loopback;
`--role` runs one of them (what the hub still does that sglang-router cannot is in the
README). SGLang's router is launch/sglang.py's.

Each role's spec is derived once from the parsed options (launch/options.py), by the same
method whether the role runs in this process (`--role`) or as a child of `--disaggregated`:
a `WorkerSpec` or the `RouterSpec` goes to its process whole (serve/specs.py), never back
through argv.
"""

from __future__ import annotations

from kvfence.hub.launch import Loopback, run_disaggregated
from kvfence.launch.options import Role, ServeOptions
from kvfence.serve.specs import RouterSpec, WorkerSpec
from kvfence.serve.startup import collector_paused
from kvfence.serve.tenants import TenantRegistry


def pd_main(options: ServeOptions, tenants: TenantRegistry) -> int:
    """Run the hub topology the options name; ServeOptions has checked which flags it needs."""
    if options.disaggregated:
        return _disaggregated(options, tenants)
    assert options.role is not None and options.inbox is not None  # pd_router is None otherwise
    if options.role is Role.ROUTER:
        router = options.router_spec(options.inbox, options.prefill_addr, options.decode_addr)
        with collector_paused():  # start-up imports (serve/startup.py)
            from kvfence.hub.router_role import run_router  # the web stack: past validation

        return run_router(router, tenants)
    from kvfence.hub.worker_entry import run_worker_process

    assert options.router_addr is not None
    return run_worker_process(options.worker_spec(options.role, options.inbox, options.router_addr))


def _disaggregated(options: ServeOptions, tenants: TenantRegistry) -> int:
    threads = options.worker_threads

    def spec_for(role: str, inbox: str, router_addr: str) -> WorkerSpec:
        return options.worker_spec(Role(role), inbox, router_addr, torch_threads=threads)

    def router_for(addrs: Loopback) -> RouterSpec:
        return options.router_spec(addrs.router, addrs.prefill, addrs.decode)

    return run_disaggregated(
        spec_for,
        router_for,
        n_prefill=options.n_prefill,
        n_decode=options.n_decode,
        tenants=tenants,
    )
