"""`kvfence serve --router sglang …`: the workers behind SGLang's router, and the whole stack."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from kvfence.launch.options import ServeOptions, sglang_worker_spec, stack_spec
from kvfence.serve.startup import collector_paused, set_torch_threads
from kvfence.serve.supervisor import interrupts_unwind
from kvfence.serve.tenants import TenantRegistry


def run_stack(options: ServeOptions, tenants: TenantRegistry) -> int:
    """sglang-router + the workers, supervised together; the router's URL is the public one."""
    from kvfence.sglang_stack.stack import Stack

    with tempfile.TemporaryDirectory(prefix="kvfence-tenants-") as tmp:
        tenants_file = Path(tmp) / "tenants.json"
        tenants_file.touch(mode=0o600)
        tenants_file.write_text(tenants.to_json())
        stack = Stack(stack_spec(options, tenants_file))
        with interrupts_unwind():
            return _run(stack, tenants)


def _run(stack: Any, tenants: TenantRegistry) -> int:
    from kvfence.sglang_stack.stack import StackError

    try:
        stack.start()
        _announce(stack, tenants)
        name, rc = stack.first_exit()
        click.echo(f"kvfence: {name} exited with code {rc}; stopping the stack", err=True)
        return int(rc or 1)
    except StackError as e:
        click.echo(f"kvfence: the stack did not start: {e}", err=True)
        return 1
    except KeyboardInterrupt:
        click.echo("kvfence: interrupted; stopping the router and every worker", err=True)
        return 0
    finally:
        stack.stop()


def _announce(stack: Any, tenants: TenantRegistry) -> None:
    click.echo(f"sglang-router (PD mode) at {stack.url}  (OpenAI base URL: {stack.url}/v1)")
    click.echo(f"  its admin API (workers, loads): {stack.admin_url} only, with the operator key")
    for w in stack.workers:
        click.echo(
            f"  {w.name}: {w.url}"
            + (f"  bootstrap port {w.bootstrap_port}" if w.bootstrap_port else "")
        )
    for t in tenants.tenants:
        click.echo(f"tenant {t.name}: key {t.keys[0]}")
    if tenants.operator_keys:
        click.echo(f"operator key: {tenants.operator_keys[0]}")
    if not set(stack.admin_keys) & set(tenants.operator_keys):
        click.echo(f"router admin key: {stack.admin_keys[0]}")
    click.echo(f"logs: {stack.workdir}")
    sys.stdout.flush()


def check_sglang_router_installed() -> None:
    """A usage error (exit 2) naming the extra, and the fix that needs none."""
    if importlib.util.find_spec("sglang_router") is None:
        raise click.UsageError(
            "sglang-router is not installed (pip install 'kvfence[pd]'); "
            "or use kvfence's own router: --router kvfence"
        )


def sglang_main(options: ServeOptions, tenants: TenantRegistry) -> int:
    """The whole stack (`--disaggregated`), or one worker of it (`--role prefill|decode`)."""
    check_sglang_router_installed()
    if options.disaggregated:
        return run_stack(options, tenants)
    assert options.role is not None  # ServeOptions: --role prefill|decode here
    # No kvfence control plane: the bootstrap channel replaces the inbox and the router.
    worker = options.worker_spec(options.role, inbox="-", router_addr="-")
    with collector_paused():  # start-up imports (serve/startup.py)
        from kvfence.sglang_stack.worker import run_sglang_worker  # torch

        set_torch_threads(worker.torch_threads)
    rc = run_sglang_worker(sglang_worker_spec(options, worker), tenants)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # as the other workers: skip a slow finalisation of torch and zmq state
