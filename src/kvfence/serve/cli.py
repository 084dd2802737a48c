"""`kvfence serve`: the single-process OpenAI-compatible server.

With no arguments: the tiny checkpoint (made on first use in the cache
directory), the in-process pipeline, loopback, a free port, and two tenants
with fresh keys; it prints the URL, a key and a ready-to-paste curl line.
The capacity gate (I4) runs on the live pools before anything listens: a
failing gate exits 1 with the gate's message on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvfence.engine.config import EngineConfig, default_of
from kvfence.engine.prefill_order import PrefillOrder
from kvfence.engine.sizing import DEFAULT_HEADROOM, CapacityGateError
from kvfence.faults import FaultSet
from kvfence.kv.scrub import ScrubPolicy
from kvfence.model.config import MODEL_KINDS
from kvfence.model.tiny import PRESETS, default_checkpoint_dir
from kvfence.serve.announce import announce
from kvfence.serve.config import Capacity, ServeConfig
from kvfence.serve.pd.spec import CROSS_PROCESS, WorkerSpec, is_loopback
from kvfence.serve.per_role import parse_per_role
from kvfence.serve.pool_sizing import DEFAULT_KV_FRACTION, PoolSizes, gate_fix_hint
from kvfence.serve.startup import collector_paused, quiet_torch_import
from kvfence.serve.tenants import TenantFileError, TenantRegistry

if TYPE_CHECKING:
    from kvfence.serve.build import ServerParts

# Torch, the model, the web stack and the PD roles are imported where they are used: the
# `--disaggregated` supervisor and the router role never load a model, and on a
# shared machine every torch import they skip is start-up time for the workers.

EXIT_GATE = 1


@click.command()
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="HF model directory [default: the tiny checkpoint, made on first use]",
)
@click.option(
    "--preset",
    type=click.Choice(sorted(PRESETS)),
    default="tiny",
    show_default=True,
    help="the embedded checkpoint to make and use when --model is not given",
)
@click.option("--model-kind", type=click.Choice(MODEL_KINDS), default="llama", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="0 = any free port")
@click.option(
    "--tenants",
    "tenants_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help='JSON {"tenants": [{"name": ..., "keys": [...]}]} [default: two generated tenants]; '
    "a tenant without limits gets the defaults (one longest prompt waiting, a quarter of the "
    'prefill pool in flight, 20 refusals then 2/s), "limits": "unlimited" none',
)
@click.option("--unlimited-tenants", is_flag=True, help="no default limits (explicit choice)")
@click.option("--no-auth", is_flag=True, help="dev mode: one tenant, no keys (loopback only)")
@click.option(
    "--operator-key",
    "operator_keys",
    multiple=True,
    help="a key that reads operator data (/metrics, pool usage, lab facts); repeatable",
)
@click.option(
    "--context-length", type=click.IntRange(1), default=None, help="[default: the model's]"
)
@click.option("--kv-pages", default=None, help="KV pages per role: N, or prefill=N,decode=M")
@click.option(
    "--kv-bytes",
    default=None,
    help="KV bytes per role: N, or prefill=N,decode=M [default: sized from the available memory]",
)
@click.option(
    "--kv-memory-fraction",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=DEFAULT_KV_FRACTION,
    show_default=True,
    help="without --kv-pages/--kv-bytes: the most of the available memory each role's pool takes",
)
@click.option(
    "--page-size",
    type=click.IntRange(1),
    default=default_of(EngineConfig, "page_size"),
    show_default=True,
)
@click.option(
    "--max-batch-tokens",
    type=click.IntRange(1),
    default=default_of(EngineConfig, "max_batch_tokens"),
    show_default=True,
    help="the step budget: new tokens one engine step computes (decode's first, then prompt "
    "chunks); smaller answers first tokens sooner, larger packs prefill tighter",
)
@click.option(
    "--prefill-order",
    type=click.Choice([o.value for o in PrefillOrder]),
    default=default_of(EngineConfig, "prefill_order").value,
    show_default=True,
    help="the order waiting prompts are admitted in: shortest first (no prompt is overtaken "
    f"by more than {default_of(EngineConfig, 'max_overtakes')} later arrivals) or arrival order",
)
@click.option(
    "--scrub",
    type=click.Choice([p.value for p in ScrubPolicy]),
    default=ScrubPolicy.NONE.value,
    show_default=True,
)
@click.option("--no-prefix-cache", is_flag=True, help="turn the prefix cache off")
@click.option(
    "--shared-prefix-cache",
    is_flag=True,
    help="explicit opt-in: one prefix cache for all tenants (I8 off by choice)",
)
@click.option(
    "--allow-undersized-pool",
    is_flag=True,
    help="start even if the gate fails; reject prompt + max_tokens > pool with HTTP 400",
)
@click.option("--headroom", type=float, default=DEFAULT_HEADROOM, show_default=True)
@click.option(
    "--lab-fault",
    "lab_faults",
    multiple=True,
    help="incident lab: switch a defence off (repeatable; listed in /server_info)",
)
@click.option(
    "--default-max-tokens",
    type=click.IntRange(1),
    default=default_of(ServeConfig, "default_max_tokens"),
    show_default=True,
)
@click.option(
    "--request-log",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="append one JSON line per request (tenant hash, tokens, prefill_s, ttft_s, outcome)",
)
@click.option("--log-level", default="warning", show_default=True)
@click.option(
    "--disaggregated",
    is_flag=True,
    help="sglang-router (PD mode) + prefill + decode workers as separate processes on loopback",
)
@click.option("--prefill", "n_prefill", type=click.IntRange(1), default=1, show_default=True)
@click.option("--decode", "n_decode", type=click.IntRange(1), default=1, show_default=True)
@click.option(
    "--transport",
    type=click.Choice(CROSS_PROCESS),
    default=default_of(WorkerSpec, "transport"),
    show_default=True,
    help="KV transport between prefill and decode processes (mooncake, nixl: the pd extra)",
)
@click.option(
    "--role",
    type=click.Choice(["router", "prefill", "decode"]),
    default=None,
    help="run one role (multi-host); give the addresses of the others",
)
@click.option("--inbox", default=None, help="this role's control address, e.g. tcp://10.0.0.2:7001")
@click.option("--router-addr", default=None, help="workers: the router's control address")
@click.option("--prefill-addr", multiple=True, help="router: a prefill worker's control address")
@click.option("--decode-addr", multiple=True, help="router: a decode worker's control address")
@click.option(
    "--kv-host",
    default=default_of(WorkerSpec, "kv_host"),
    show_default=True,
    help="decode: KV listen address",
)
@click.option(
    "--router",
    "pd_router",
    type=click.Choice(["kvfence", "sglang"]),
    default=None,
    help="the PD router in front: SGLang's sglang-router (the default of --disaggregated; "
    "the pd extra) or kvfence's own hub (the default of --role)",
)
@click.option(
    "--bootstrap-port",
    type=click.IntRange(0, 65535),
    default=0,
    help="--router sglang --role prefill: the bootstrap port decode registers at (0 = any)",
)
@click.option(
    "--router-secret-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="--router sglang --role prefill|decode: the router credential (its worker URL path)",
)
@click.option(
    "--torch-threads",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="intra-op threads for the model (0 = torch's default; --disaggregated splits the cores)",
)
def serve(
    model_dir: Path | None,
    preset: str,
    model_kind: str,
    host: str,
    port: int,
    tenants_file: Path | None,
    no_auth: bool,
    operator_keys: tuple[str, ...],
    unlimited_tenants: bool,
    context_length: int | None,
    kv_pages: str | None,
    kv_bytes: str | None,
    kv_memory_fraction: float,
    page_size: int,
    max_batch_tokens: int,
    prefill_order: str,
    scrub: str,
    no_prefix_cache: bool,
    shared_prefix_cache: bool,
    allow_undersized_pool: bool,
    headroom: float,
    lab_faults: tuple[str, ...],
    default_max_tokens: int,
    request_log: Path | None,
    log_level: str,
    disaggregated: bool,
    n_prefill: int,
    n_decode: int,
    transport: str,
    role: str | None,
    inbox: str | None,
    router_addr: str | None,
    prefill_addr: tuple[str, ...],
    decode_addr: tuple[str, ...],
    kv_host: str,
    pd_router: str | None,
    bootstrap_port: int,
    router_secret_file: Path | None,
    torch_threads: int,
) -> None:
    """Serve a model over the OpenAI API, with tenant isolation (exit 1: capacity gate failed)."""
    try:
        faults = FaultSet.parse(lab_faults)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--lab-fault") from None
    tenants = _tenants(tenants_file, no_auth, host, operator_keys, unlimited_tenants)
    prefill_pages, decode_pages = parse_per_role(kv_pages, "--kv-pages")
    prefill_bytes, decode_bytes = parse_per_role(kv_bytes, "--kv-bytes")
    sizes = (prefill_pages, decode_pages, prefill_bytes, decode_bytes, kv_memory_fraction)
    if model_dir is None:
        click.echo(f"using the embedded {preset} checkpoint (made on first use)...", err=True)
        model_dir = default_checkpoint_dir(preset=preset)
    params = click.get_current_context().params
    quiet_torch_import()  # before any role imports torch; children inherit it
    if disaggregated or role is not None:
        from kvfence.serve.pd.cli import pd_main
        from kvfence.serve.transfer.native import missing_native

        if (missing := missing_native(transport)) is not None:
            raise click.UsageError(missing)

        sys.exit(pd_main(params, faults, tenants, model_dir, announce))
    _serve_local(params, faults, tenants, model_dir, sizes)


def _serve_local(
    params: dict[str, Any],
    faults: FaultSet,
    tenants: TenantRegistry,
    model_dir: Path,
    sizes: tuple[int | None, int | None, int | None, int | None, float],
) -> None:
    """The single-process server: build -> capacity gate (I4) -> listen -> serve until stopped."""
    with collector_paused():  # the imports and the build (serve/startup.py)
        from kvfence.engine.threads import keep_one_for_engine
        from kvfence.serve.app import create_app
        from kvfence.serve.thread import bind, serve_forever, url_of

        engine_threads = keep_one_for_engine(params["torch_threads"])  # engine/threads.py
        parts = _build_local(params, faults, model_dir, sizes, engine_threads)
        capacity = _gate(parts)
        app = create_app(
            parts.pipeline,
            parts.loaded.tokenizer,
            parts.config,
            tenants,
            capacity=capacity,
            request_log=params["request_log"],
        )
        sock = bind(params["host"], params["port"])
    url = url_of(sock)
    announce(url, tenants, parts.config.model_name, capacity.report.message())
    parts.pipeline.start()
    try:
        serve_forever(app, sock, log_level=params["log_level"])
    finally:
        parts.pipeline.stop()
        sock.close()
        click.echo("kvfence: stopped", err=True)


def _build_local(
    params: dict[str, Any],
    faults: FaultSet,
    model_dir: Path,
    sizes: tuple[int | None, int | None, int | None, int | None, float],
    torch_threads: int,
) -> ServerParts:
    from kvfence.serve.build import build_local

    try:
        parts = build_local(
            model_dir,
            kind=params["model_kind"],
            context_length=params["context_length"],
            pools=PoolSizes(*sizes),
            page_size=params["page_size"],
            max_batch_tokens=params["max_batch_tokens"],
            prefill_order=PrefillOrder(params["prefill_order"]),
            scrub=ScrubPolicy(params["scrub"]),
            faults=faults,
            prefix_cache=not params["no_prefix_cache"],
            shared_prefix_cache=params["shared_prefix_cache"],
            headroom=params["headroom"],
            allow_undersized_pool=params["allow_undersized_pool"],
            default_max_tokens=params["default_max_tokens"],
            torch_threads=torch_threads,
        )
    except (OSError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    for line in parts.sizing:
        click.echo(line, err=True)
    return parts


def _gate(parts: ServerParts) -> Capacity:
    """The capacity gate on the live pools; a failing gate exits 1 with its message (I4)."""
    from kvfence.serve.config import decide_capacity

    try:
        return decide_capacity(parts.config, parts.pipeline.stats().pools)
    except CapacityGateError as e:
        click.echo(str(e), err=True)  # I4: the server does not start
        click.echo(gate_fix_hint(e.report, parts.geometry), err=True)
        sys.exit(EXIT_GATE)


def _tenants(
    path: Path | None, no_auth: bool, host: str, keys: tuple[str, ...] = (), unlimited: bool = False
) -> TenantRegistry:
    if no_auth:
        if path is not None or keys:
            raise click.UsageError("--no-auth excludes --tenants and --operator-key")
        if not is_loopback(host):
            raise click.UsageError("--no-auth is only allowed on a loopback host")
        return TenantRegistry.dev()
    if path is None:
        registry = TenantRegistry.generate()
    else:
        try:
            registry = TenantRegistry.from_file(path)
        except TenantFileError as e:
            raise click.BadParameter(str(e), param_hint="--tenants") from None
    registry = registry.without_default_limits() if unlimited else registry
    try:
        return registry.with_operator_keys(keys)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--operator-key") from None
