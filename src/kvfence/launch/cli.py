"""`kvfence serve`: every topology's entry point, and the single-process server.

The options are parsed once, into a `ServeOptions` (launch/options.py): each click option's
parameter name is one of its fields, and its type converts the flag. With no arguments: the
tiny checkpoint (made on first use in the cache directory), the in-process pipeline,
loopback, a free port, and two tenants with fresh keys; it prints the URL, a key and a
ready-to-paste curl line. The capacity gate (I4) runs on the live pools before anything
listens: a failing gate exits 1 with the gate's message on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from kvfence.engine.config import EngineConfig, default_of
from kvfence.engine.prefill_order import PrefillOrder
from kvfence.engine.sizing import DEFAULT_HEADROOM
from kvfence.kv.scrub import ScrubPolicy
from kvfence.launch.option_types import PER_ROLE, EnumChoice, PerRole, parse_faults
from kvfence.launch.options import PDRouter, Role, ServeOptions
from kvfence.model.config import MODEL_KINDS
from kvfence.model.tiny import PRESETS
from kvfence.serve.announce import announce
from kvfence.serve.config import Capacity, ServeConfig
from kvfence.serve.pool_sizing import DEFAULT_KV_FRACTION, gate_fix_hint
from kvfence.serve.process_tuning import tune_serving_process
from kvfence.serve.specs import CROSS_PROCESS, LOG_LEVELS, SglangWorkerSpec, WorkerSpec
from kvfence.serve.startup import collector_paused, quiet_torch_import
from kvfence.serve.tenants import TenantFileError, TenantRegistry

# Torch, the model, the web stack and the PD roles are imported where they are used: the
# `--disaggregated` supervisor and the router role never load a model, and on a
# shared machine every torch import they skip is start-up time for the workers.


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
@click.option(
    "--kv-pages",
    type=PER_ROLE,
    default=PerRole(),
    help="KV pages per role: N, or prefill=N,decode=M",
)
@click.option(
    "--kv-bytes",
    type=PER_ROLE,
    default=PerRole(),
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
    type=EnumChoice(PrefillOrder),
    default=default_of(EngineConfig, "prefill_order").value,
    show_default=True,
    help="the order waiting prompts are admitted in: shortest first (no prompt is overtaken "
    f"by more than {default_of(EngineConfig, 'max_overtakes')} later arrivals) or arrival order",
)
@click.option(
    "--scrub",
    type=EnumChoice(ScrubPolicy),
    default=default_of(EngineConfig, "scrub").value,
    show_default=True,
)
@click.option(
    "--prefix-cache/--no-prefix-cache",
    default=default_of(EngineConfig, "prefix_cache"),
    show_default=True,
    help="the prefix cache, one per tenant (I8)",
)
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
@click.option(
    "--headroom",
    type=click.FloatRange(min=1.0),
    default=DEFAULT_HEADROOM,
    show_default=True,
    help="the gate's margin: the pool must hold context x headroom (I4)",
)
@click.option(
    "--lab-fault",
    "faults",
    multiple=True,
    callback=parse_faults,
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
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="warning",
    show_default=True,
)
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
    type=EnumChoice(Role),
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
    type=EnumChoice(PDRouter),
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
    help=(
        "intra-op threads for the model (0 = torch's default; --disaggregated: the workers "
        "take turns on every core behind sglang-router and split the cores behind the hub; "
        "a count here fixes each worker's)"
    ),
)
@click.option(
    "--pair-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=default_of(SglangWorkerSpec, "pair_timeout"),
    show_default=True,
    help="sglang-router stack: seconds one worker of a pair waits for the other (or for word "
    "from it) before the request fails with 504 and decode gives its room up",
)
def serve(**given: Any) -> None:
    """Serve a model over the OpenAI API, with tenant isolation (exit 1: capacity gate failed)."""
    tune_serving_process()  # first: before anything this command runs can import torch
    options = ServeOptions(**given)
    tenants = _tenants(options)
    if options.model_dir is None:
        click.echo(
            f"using the embedded {options.preset} checkpoint (made on first use)...", err=True
        )
        options = replace(options, model_dir=options.checkpoint)
    quiet_torch_import()  # before any role imports torch; children inherit it
    if options.pd_router is None:
        sys.exit(_serve_local(options, tenants))
    from kvfence.transfer.native import missing_native

    if (missing := missing_native(options.transport)) is not None:
        raise click.UsageError(missing)
    if options.pd_router is PDRouter.SGLANG:
        from kvfence.launch.sglang import sglang_main

        sys.exit(sglang_main(options, tenants))
    from kvfence.launch.hub import pd_main

    sys.exit(pd_main(options, tenants))


def _serve_local(options: ServeOptions, tenants: TenantRegistry) -> int:
    """The single-process server: build, then the start-up sequence (serve/serving.py)."""
    with collector_paused():  # the imports and the build (serve/startup.py)
        from kvfence.engine.threads import keep_one_for_engine
        from kvfence.serve.serving import Listen, Server, run_server

        parts = options.build_local(keep_one_for_engine(options.torch_threads))
    for line in parts.sizing:
        click.echo(line, err=True)
    server = Server(
        parts.pipeline, parts.loaded.tokenizer, parts.config, tenants, options.request_log
    )

    def listening(url: str, capacity: Capacity) -> None:
        announce(url, tenants, parts.config.model_name, capacity.report.message())

    rc = run_server(
        server,
        Listen(options.host, options.port, options.log_level),
        listening,
        gate_hint=lambda report: gate_fix_hint(report, parts.geometry),
    )
    if rc == 0:
        click.echo("kvfence: stopped", err=True)
    return rc


def _tenants(options: ServeOptions) -> TenantRegistry:
    """The tenant registry: the dev tenant (`--no-auth`, checked by ServeOptions), the file's,
    or two generated tenants."""
    if options.no_auth:
        return TenantRegistry.dev()
    if options.tenants_file is None:
        registry = TenantRegistry.generate()
    else:
        try:
            registry = TenantRegistry.from_file(options.tenants_file)
        except TenantFileError as e:
            raise click.BadParameter(str(e), param_hint="--tenants") from None
    registry = registry.without_default_limits() if options.unlimited_tenants else registry
    try:
        return registry.with_operator_keys(options.operator_keys)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--operator-key") from None
