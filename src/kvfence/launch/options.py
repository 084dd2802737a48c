"""`kvfence serve`'s options, parsed once into one frozen, typed value.

The click options (launch/cli.py) convert each flag to its type as they parse (enums as enums,
paths as `Path`, `--kv-pages` as a `PerRole`, `--lab-fault` as a `FaultSet`), and each
option's parameter name is a field here, so `ServeOptions(**ctx.params)` is the whole
hand-over. What no single flag can check (one flag excluding or needing another) is checked
once, in `__post_init__`, with a usage error that names the flags. Every role's spec is
derived from this value by one function, whichever process the role runs in.

Torch-free, like the specs it builds: the supervisor and the router role import it.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvfence.engine.prefill_order import PrefillOrder
from kvfence.faults import FaultSet
from kvfence.kv.scrub import ScrubPolicy
from kvfence.launch.option_types import PerRole
from kvfence.serve.specs import RouterSpec, SglangWorkerSpec, WorkerSpec, is_loopback

if TYPE_CHECKING:
    from kvfence.serve.build import LocalSpec, ServerParts
    from kvfence.sglang_stack.stack import StackSpec


class Role(enum.Enum):
    """`--role`: the one role this process runs (multi-host)."""

    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"


class PDRouter(enum.Enum):
    """`--router`: the router in front of the prefill and decode workers."""

    KVFENCE = "kvfence"  # kvfence's own hub (hub/)
    SGLANG = "sglang"  # SGLang's sglang-router (sglang_stack/)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Every `kvfence serve` option, typed; one field per click option, named as its parameter."""

    model_dir: Path | None  # --model; None: the embedded `preset` checkpoint
    preset: str
    model_kind: str
    host: str
    port: int
    tenants_file: Path | None  # --tenants
    unlimited_tenants: bool
    no_auth: bool
    operator_keys: tuple[str, ...]  # --operator-key, repeatable
    context_length: int | None  # None: the model's
    kv_pages: PerRole
    kv_bytes: PerRole
    kv_memory_fraction: float
    page_size: int
    max_batch_tokens: int
    prefill_order: PrefillOrder
    scrub: ScrubPolicy
    prefix_cache: bool
    shared_prefix_cache: bool  # the operator's explicit opt-in: one cache for all (I8 off)
    allow_undersized_pool: bool
    headroom: float
    faults: FaultSet  # --lab-fault, repeatable
    default_max_tokens: int
    request_log: Path | None
    log_level: str
    disaggregated: bool
    n_prefill: int  # --prefill
    n_decode: int  # --decode
    transport: str
    role: Role | None
    inbox: str | None
    router_addr: str | None
    prefill_addr: tuple[str, ...]
    decode_addr: tuple[str, ...]
    kv_host: str
    router: PDRouter | None  # None: sglang for --disaggregated, kvfence's hub for --role
    bootstrap_port: int
    router_secret_file: Path | None
    torch_threads: int  # 0: torch's default (co-located workers split the cores)
    pair_timeout: float  # seconds; the sglang-router stack's workers

    def __post_init__(self) -> None:
        self._check_auth()
        if self.disaggregated and self.role is not None:
            raise click.UsageError("--disaggregated starts every role; --role runs one of them")
        if self.router is not None and self.pd_router is None:
            raise click.UsageError(
                "--router chooses the router in front of the workers: give --disaggregated "
                "or --role with it"
            )
        if self.pd_router is PDRouter.SGLANG:
            self._check_real_stack()
        elif self.role is not None:
            self._check_hub_role(self.role)

    @property
    def checkpoint(self) -> Path:
        """The model directory; `--model` or the embedded checkpoint, made on first use."""
        if self.model_dir is not None:
            return self.model_dir
        from kvfence.model.tiny import default_checkpoint_dir  # writes files: only when used

        return default_checkpoint_dir(preset=self.preset)

    @property
    def pd_router(self) -> PDRouter | None:
        """`--router`, or its default: sglang-router for `--disaggregated` (the real PD stack),
        kvfence's own hub for `--role`; None for the single process."""
        if not (self.disaggregated or self.role is not None):
            return None
        default = PDRouter.SGLANG if self.disaggregated else PDRouter.KVFENCE
        return self.router or default

    @property
    def worker_threads(self) -> int:
        """Each co-located worker's intra-op threads: `--torch-threads`, or the cores split
        between the workers instead of oversubscribing them."""
        workers = self.n_prefill + self.n_decode
        return self.torch_threads or max(1, (os.cpu_count() or 1) // workers)

    def _check_auth(self) -> None:
        if not self.no_auth:
            return
        if self.tenants_file is not None or self.operator_keys:
            raise click.UsageError("--no-auth excludes --tenants and --operator-key")
        if not is_loopback(self.host):
            raise click.UsageError("--no-auth is only allowed on a loopback host")

    def _check_real_stack(self) -> None:
        """Options the sglang-router stack would drop silently are refused (the fix is `--router
        kvfence`); a worker of the stack needs the router's credential."""
        given = ["--request-log (written by kvfence's own router)"] if self.request_log else []
        if self.no_auth and self.disaggregated:
            given.append("--no-auth (a keyless dev tenant cannot be handed to the stack's workers)")
        if given:
            raise click.UsageError(
                f"not with sglang-router: {'; '.join(given)}. Use --router kvfence for these"
            )
        if self.role is Role.ROUTER:
            raise click.UsageError(
                "with --router sglang, --role is prefill or decode (the router is sglang-router: "
                "python -m sglang_router.launch_router --pd-disaggregation …)"
            )
        if self.role is not None and self.router_secret_file is None:
            raise click.UsageError(
                "--router sglang --role prefill|decode needs --router-secret-file (the router "
                "credential: the router reaches this worker at URL/r/<secret>)"
            )

    def _check_hub_role(self, role: Role) -> None:
        if self.inbox is None:
            raise click.UsageError(
                f"--role {role.value} needs --inbox (this role's control address)"
            )
        if role is Role.ROUTER and not (self.prefill_addr and self.decode_addr):
            raise click.UsageError(
                "--role router needs --prefill-addr and --decode-addr (at least one each)"
            )
        if role is not Role.ROUTER and self.router_addr is None:
            raise click.UsageError(
                f"--role {role.value} needs --router-addr (the router's control address)"
            )

    # ---- what each role is built from ------------------------------------------------------

    def local_spec(self) -> LocalSpec:
        """The single process's spec (importing it loads torch: only on that path)."""
        from kvfence.serve.build import LocalSpec
        from kvfence.serve.pool_sizing import PoolSizes

        pools = PoolSizes(
            self.kv_pages.prefill,
            self.kv_pages.decode,
            self.kv_bytes.prefill,
            self.kv_bytes.decode,
            self.kv_memory_fraction,
        )
        return LocalSpec(
            self.checkpoint,
            kind=self.model_kind,
            context_length=self.context_length,
            pools=pools,
            page_size=self.page_size,
            max_batch_tokens=self.max_batch_tokens,
            prefill_order=self.prefill_order,
            scrub=self.scrub,
            prefix_cache=self.prefix_cache,
            shared_prefix_cache=self.shared_prefix_cache,
            faults=self.faults,
            headroom=self.headroom,
            allow_undersized_pool=self.allow_undersized_pool,
            default_max_tokens=self.default_max_tokens,
        )

    def build_local(self, torch_threads: int) -> ServerParts:
        """The single-process server's parts (loads the model); a bad value is a usage error."""
        from kvfence.serve.build import build_local

        try:
            return build_local(self.local_spec(), torch_threads=torch_threads)
        except (OSError, ValueError) as e:
            raise click.UsageError(str(e)) from None

    def worker_spec(
        self, role: Role, inbox: str, router_addr: str, torch_threads: int | None = None
    ) -> WorkerSpec:
        """One worker's spec; `torch_threads` overrides `--torch-threads`."""
        return WorkerSpec(
            role=role.value,
            model_dir=str(self.checkpoint),
            model_kind=self.model_kind,
            inbox=inbox,
            router_addr=router_addr,
            kv_pages=self.kv_pages.of(role.value),
            kv_bytes=self.kv_bytes.of(role.value),
            kv_memory_fraction=self.kv_memory_fraction,
            page_size=self.page_size,
            max_batch_tokens=self.max_batch_tokens,
            prefill_order=self.prefill_order.value,
            context_length=self.context_length,
            scrub=self.scrub.value,
            prefix_cache=self.prefix_cache,
            shared_prefix_cache=self.shared_prefix_cache,
            faults=tuple(self.faults.names()),
            transport=self.transport,
            kv_host=self.kv_host,
            torch_threads=self.torch_threads if torch_threads is None else torch_threads,
        )

    def router_spec(
        self, inbox: str, prefill_addr: tuple[str, ...], decode_addr: tuple[str, ...]
    ) -> RouterSpec:
        """The hub's spec, given the workers' control addresses; a bad value is a usage error
        (exit 2) before any process starts or anything binds."""
        try:
            return RouterSpec(
                model_dir=str(self.checkpoint),
                inbox=inbox,
                prefill_addr=prefill_addr,
                decode_addr=decode_addr,
                host=self.host,
                port=self.port,
                transport=self.transport,
                context_length=self.context_length,
                headroom=self.headroom,
                allow_undersized_pool=self.allow_undersized_pool,
                faults=tuple(self.faults.names()),
                default_max_tokens=self.default_max_tokens,
                scrub=self.scrub.value,
                prefix_cache=self.prefix_cache,
                shared_prefix_cache=self.shared_prefix_cache,
                log_level=self.log_level,
                request_log=None if self.request_log is None else str(self.request_log),
                tenants_file=None if self.tenants_file is None else str(self.tenants_file),
                no_auth=self.no_auth,
            )
        except ValueError as e:
            raise click.UsageError(f"bad router options: {e}") from None


def read_secret(path: Path) -> str:
    secret = path.read_text().strip()
    if len(secret) < 16 or not secret.isalnum():
        raise click.BadParameter(
            "the router secret must be at least 16 letters or digits",
            param_hint="--router-secret-file",
        )
    return secret


def sglang_worker_spec(options: ServeOptions, worker: WorkerSpec) -> SglangWorkerSpec:
    """`--router sglang --role prefill|decode`: the worker's engine spec and its HTTP side."""
    assert options.router_secret_file is not None  # ServeOptions checks it is given
    return SglangWorkerSpec(
        worker=worker,
        secret=read_secret(options.router_secret_file),
        host=options.host,
        port=options.port,
        bootstrap_port=options.bootstrap_port,
        headroom=options.headroom,
        allow_undersized_pool=options.allow_undersized_pool,
        default_max_tokens=options.default_max_tokens,
        log_level=options.log_level,
        pair_timeout=options.pair_timeout,
    )


def stack_worker_argv(options: ServeOptions) -> tuple[str, ...]:
    """The `kvfence serve` options every worker of the sglang-router stack starts with (each
    worker parses them into its own `ServeOptions`); co-located, they split the cores."""
    o = options
    given: list[tuple[str, object]] = [
        ("--model", o.checkpoint),
        ("--model-kind", o.model_kind),
        ("--context-length", o.context_length),
        ("--kv-pages", o.kv_pages if o.kv_pages != PerRole() else None),
        ("--kv-bytes", o.kv_bytes if o.kv_bytes != PerRole() else None),
        ("--kv-memory-fraction", o.kv_memory_fraction),
        ("--page-size", o.page_size),
        ("--max-batch-tokens", o.max_batch_tokens),
        ("--prefill-order", o.prefill_order.value),
        ("--scrub", o.scrub.value),
        ("--transport", o.transport),
        ("--log-level", o.log_level),
        ("--headroom", o.headroom),
        ("--default-max-tokens", o.default_max_tokens),
        ("--kv-host", o.kv_host),
        ("--torch-threads", o.worker_threads),
        ("--pair-timeout", o.pair_timeout),
        *(("--lab-fault", f) for f in o.faults.names()),
    ]
    args = [a for flag, value in given if value is not None for a in (flag, str(value))]
    flags = (
        ("--no-prefix-cache", not o.prefix_cache),
        ("--shared-prefix-cache", o.shared_prefix_cache),
        ("--allow-undersized-pool", o.allow_undersized_pool),
    )
    return (*args, *(flag for flag, on in flags if on))


def stack_spec(options: ServeOptions, tenants_file: Path) -> StackSpec:
    """`--disaggregated` behind sglang-router: the router, its edge and every worker."""
    from kvfence.sglang_stack.stack import StackSpec

    return StackSpec(
        worker_args=stack_worker_argv(options),
        tenants_file=tenants_file,
        n_prefill=options.n_prefill,
        n_decode=options.n_decode,
        host=options.host,
        port=options.port,
        # The workers take turns on every core unless `--torch-threads` fixes their count.
        share_cores=options.torch_threads == 0,
    )
