"""`kvfence serve --router sglang …`: the workers behind SGLang's router, and the whole stack."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from kvfence.faults import FaultSet
from kvfence.serve.pd.worker_entry import set_torch_threads
from kvfence.serve.startup import collector_paused
from kvfence.serve.supervisor import interrupts_unwind
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.worker_options import worker_spec


def read_secret(path: Path | None) -> str:
    if path is None:
        raise click.UsageError(
            "--router sglang --role prefill|decode needs --router-secret-file (the router "
            "credential: the router reaches this worker at URL/r/<secret>)"
        )
    secret = path.read_text().strip()
    if len(secret) < 16 or not secret.isalnum():
        raise click.BadParameter(
            "the router secret must be at least 16 letters or digits",
            param_hint="--router-secret-file",
        )
    return secret


# Options every worker of the stack gets, as `kvfence serve --disaggregated` passes them.
_SHARED = (
    "model_kind",
    "context_length",
    "kv_pages",
    "kv_bytes",
    "kv_memory_fraction",
    "page_size",
    "max_batch_tokens",
    "prefill_order",
    "scrub",
    "transport",
    "log_level",
    "headroom",
    "default_max_tokens",
    "kv_host",
)
_FLAGS = ("no_prefix_cache", "shared_prefix_cache", "allow_undersized_pool")


def worker_args(params: dict[str, Any], faults: FaultSet, model_dir: Path) -> tuple[str, ...]:
    args = ["--model", str(model_dir)]
    for name in _SHARED:
        if params[name] is not None:
            args += ["--" + name.replace("_", "-"), str(params[name])]
    args += ["--" + n.replace("_", "-") for n in _FLAGS if params[n]]
    workers = params["n_prefill"] + params["n_decode"]  # co-located: split the cores
    args += [
        "--torch-threads",
        str(params["torch_threads"] or max(1, (os.cpu_count() or 1) // workers)),
    ]
    for f in faults.names():
        args += ["--lab-fault", f]
    return tuple(args)


def run_stack(
    params: dict[str, Any], faults: FaultSet, tenants: TenantRegistry, model_dir: Path
) -> int:
    """sglang-router + the workers, supervised together; the router's URL is the public one."""
    from kvfence.serve.sglang.stack import Stack, StackSpec

    with tempfile.TemporaryDirectory(prefix="kvfence-tenants-") as tmp:
        tenants_file = Path(tmp) / "tenants.json"
        tenants_file.touch(mode=0o600)
        tenants_file.write_text(tenants.to_json())
        spec = StackSpec(
            worker_args=worker_args(params, faults, model_dir),
            tenants_file=tenants_file,
            n_prefill=params["n_prefill"],
            n_decode=params["n_decode"],
            host=params["host"],
            port=params["port"],
        )
        stack = Stack(spec)
        with interrupts_unwind():
            return _run(stack, tenants)


def _run(stack: Any, tenants: TenantRegistry) -> int:
    from kvfence.serve.sglang.stack import StackError

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


def sglang_main(
    params: dict[str, Any], faults: FaultSet, tenants: TenantRegistry, model_dir: Path
) -> int:
    role = params["role"]
    if params["disaggregated"]:
        if role is not None:
            raise click.UsageError("--disaggregated starts every role; --role runs one of them")
        return run_stack(params, faults, tenants, model_dir)
    if role not in ("prefill", "decode"):
        raise click.UsageError(
            "with --router sglang, --role is prefill or decode (the router is sglang-router: "
            "python -m sglang_router.launch_router --pd-disaggregation …)"
        )
    # No kvfence control plane: the bootstrap channel replaces the inbox and the router.
    worker = worker_spec(params, faults, model_dir, role, inbox="-", router="-")
    with collector_paused():  # start-up imports (serve/startup.py)
        from kvfence.serve.sglang.worker import SglangWorkerSpec, run_sglang_worker  # torch

        set_torch_threads(worker.torch_threads)
    spec = SglangWorkerSpec(
        worker=worker,
        secret=read_secret(params["router_secret_file"]),
        host=params["host"],
        port=params["port"],
        bootstrap_port=params["bootstrap_port"],
        headroom=params["headroom"],
        allow_undersized_pool=params["allow_undersized_pool"],
        default_max_tokens=params["default_max_tokens"],
        log_level=params["log_level"],
    )
    rc = run_sglang_worker(spec, tenants)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # as the other workers: skip a slow finalisation of torch and zmq state
