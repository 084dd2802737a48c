"""What each serving process needs, whatever coordinates it: the hub's workers and router,
SGLang-style workers behind sglang-router, and the set-up both kinds of worker make from
their spec (the model, the engine config with this role's pool sized, the page shape).

Importing this module is torch-free: the CLI and the supervisor build specs without
loading a model, a transport or the web stack (tests/test_cli_lazy.py); only
`RoleSetUp.of` loads the model.

The `--disaggregated` supervisor builds each worker's `WorkerSpec` and the router's
`RouterSpec` once and hands each over as one JSON document (`write_spec`); the child
validates every field on receipt (`read_spec`) with the same strict rules as a control
message, and refuses a document of another type or version before it loads or binds
anything. `kvfence serve --role …` builds the same specs from its options.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kvfence.engine.config import EngineConfig, default_of
from kvfence.engine.messages import build_checked
from kvfence.engine.prefill_order import PrefillOrder
from kvfence.faults import FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.scrub import ScrubPolicy
from kvfence.model.config import ModelConfig
from kvfence.serve.config import ServeConfig
from kvfence.serve.pool_sizing import DEFAULT_KV_FRACTION, PoolSizes, available_memory_bytes

if TYPE_CHECKING:
    from kvfence.model.loader import LoadedModel

# Every registered transport but the in-process one joins two processes (mooncake and nixl
# need the `pd` extra). Declared here, torch-free, so the `--disaggregated` supervisor and the
# router role parse their options without importing the transports;
# tests/transfer/test_transport_protocol.py holds it equal to the registry.
CROSS_PROCESS = ("tcp", "shm", "mooncake", "nixl")

# The one prefix-cache namespace every tenant shares when the operator opts in
# (`--shared-prefix-cache`, I8 off by choice); otherwise each tenant's is its own.
SHARED_NAMESPACE = "shared"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything one worker process needs (`ServeOptions.worker_spec` derives it). Its values
    are the JSON document's: enums by their values, paths as strings."""

    role: str  # "prefill" or "decode"
    model_dir: str
    model_kind: str
    inbox: str  # the control address this worker binds, e.g. tcp://10.0.0.2:7001
    router_addr: str  # the router's control inbox (`--router-addr`)
    kv_pages: int | None = None  # this role's KV pool in pages, or
    kv_bytes: int | None = None  # a byte budget (whole pages, rounded down); default: from memory
    kv_memory_fraction: float = DEFAULT_KV_FRACTION
    page_size: int = default_of(EngineConfig, "page_size")
    max_batch_tokens: int = default_of(EngineConfig, "max_batch_tokens")  # the step budget
    prefill_order: str = default_of(EngineConfig, "prefill_order").value  # a PrefillOrder value
    context_length: int | None = None
    scrub: str = default_of(EngineConfig, "scrub").value  # a ScrubPolicy value
    prefix_cache: bool = True
    shared_prefix_cache: bool = False  # the operator's explicit opt-in (I8)
    faults: tuple[str, ...] = ()
    transport: str = "tcp"
    kv_host: str = "127.0.0.1"  # decode: the interface its KV receiver listens on
    torch_threads: int = 0  # intra-op threads for the model; 0 = torch's default

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"a worker role is 'prefill' or 'decode', got {self.role!r}")
        if self.transport not in CROSS_PROCESS:
            raise ValueError(
                f"a cross-process transport is one of {', '.join(CROSS_PROCESS)}, "
                f"got {self.transport!r}"
            )
        if self.prefill_order not in {o.value for o in PrefillOrder}:
            raise ValueError(
                f"prefill_order is one of {', '.join(o.value for o in PrefillOrder)}, "
                f"got {self.prefill_order!r}"
            )
        if self.scrub not in {p.value for p in ScrubPolicy}:
            raise ValueError(f"WorkerSpec.scrub: unknown policy {self.scrub!r}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")


def role_pages(spec: WorkerSpec, loaded: LoadedModel) -> int:
    geometry = loaded.config.kv_geometry(page_size=spec.page_size)
    pages, kv_bytes, fraction = spec.kv_pages, spec.kv_bytes, spec.kv_memory_fraction
    if spec.role == "prefill":
        sizes = PoolSizes(pages, None, kv_bytes, None, fraction)
    else:
        sizes = PoolSizes(None, pages, None, kv_bytes, fraction)
    ctx = spec.context_length or loaded.config.max_position_embeddings
    role = sizes.plan(spec.role, geometry, ctx, available=available_memory_bytes())
    print(role.how, file=sys.stderr, flush=True)  # the start-up log says how it was sized
    return role.pages


def engine_config(spec: WorkerSpec, loaded: LoadedModel) -> EngineConfig:
    """One EngineConfig for this role; the other role's pool size is irrelevant here (1 page)."""
    ctx = spec.context_length or loaded.config.max_position_embeddings
    pages = role_pages(spec, loaded)
    return EngineConfig(
        prefill_pages=pages if spec.role == "prefill" else 1,
        decode_pages=pages if spec.role == "decode" else 1,
        page_size=spec.page_size,
        max_batch_tokens=spec.max_batch_tokens,
        prefill_order=PrefillOrder(spec.prefill_order),
        context_length=ctx,
        scrub=ScrubPolicy(spec.scrub),
        prefix_cache=spec.prefix_cache,
        shared_prefix_namespace=SHARED_NAMESPACE if spec.shared_prefix_cache else None,
        eos_token_ids=loaded.tokenizer.eos_ids,
    )


@dataclass(frozen=True, slots=True)
class RoleSetUp:
    """What either role builds from its spec before its pool: the model, the lab's switches,
    the engine config (this role's pool sized) and the page shape."""

    loaded: LoadedModel
    faults: FaultSet
    config: EngineConfig
    geometry: KVGeometry

    @classmethod
    def of(cls, spec: WorkerSpec) -> RoleSetUp:
        from kvfence.model.loader import load_model  # torch: the worker's alone

        loaded = load_model(spec.model_dir, kind=spec.model_kind)
        geometry = loaded.config.kv_geometry(page_size=spec.page_size)
        return cls(loaded, FaultSet.parse(spec.faults), engine_config(spec, loaded), geometry)


# uvicorn's names for its log levels (serve/thread.py hands the router's straight to it).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """Everything the router process needs (`ServeOptions.router_spec` derives it), for `--role
    router` or the `--disaggregated` supervisor's router child."""

    model_dir: str
    inbox: str  # the router's control inbox, which the workers report to
    prefill_addr: tuple[str, ...]  # the prefill workers' control inboxes
    decode_addr: tuple[str, ...]
    host: str  # where the public API listens
    port: int
    transport: str
    context_length: int | None = None
    headroom: float = default_of(ServeConfig, "headroom")
    allow_undersized_pool: bool = False
    faults: tuple[str, ...] = ()
    default_max_tokens: int = default_of(ServeConfig, "default_max_tokens")
    scrub: str = default_of(EngineConfig, "scrub").value  # a ScrubPolicy value
    prefix_cache: bool = True
    shared_prefix_cache: bool = False
    log_level: str = "warning"
    request_log: str | None = None
    tenants_file: str | None = None  # the tenant registry, as `--tenants` reads it
    no_auth: bool = False  # dev mode: one tenant, no keys (loopback hosts only)

    def __post_init__(self) -> None:
        for role, value in (("prefill", self.prefill_addr), ("decode", self.decode_addr)):
            if not value:
                raise ValueError(
                    f"RouterSpec.{role}_addr needs at least one {role} worker's address"
                )
        if self.transport not in CROSS_PROCESS:
            raise ValueError(
                f"RouterSpec.transport is one of {', '.join(CROSS_PROCESS)}, got {self.transport!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"RouterSpec.port must be in 0..65535, got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"RouterSpec.log_level is one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.scrub not in {p.value for p in ScrubPolicy}:
            raise ValueError(f"RouterSpec.scrub: unknown policy {self.scrub!r}")
        FaultSet.parse(self.faults)  # an unknown switch names itself and the known ones
        self._check_auth()

    def _check_auth(self) -> None:
        if self.no_auth and self.tenants_file is not None:
            raise ValueError("RouterSpec.no_auth excludes RouterSpec.tenants_file")
        if self.no_auth and not is_loopback(self.host):
            raise ValueError(
                f"RouterSpec.no_auth (dev mode) is only allowed on a loopback host, "
                f"got host {self.host!r}"
            )

    def serve_config(self) -> ServeConfig:
        """The router's config, with the model's facts read from its config.json."""
        config = ModelConfig.from_file(Path(self.model_dir) / "config.json")
        return ServeConfig(
            model_name=Path(self.model_dir).name,
            context_length=self.context_length or config.max_position_embeddings,
            vocab_size=config.vocab_size,
            headroom=self.headroom,
            allow_undersized_pool=self.allow_undersized_pool,
            faults=FaultSet.parse(self.faults),
            default_max_tokens=self.default_max_tokens,
            scrub=ScrubPolicy(self.scrub),
            transport=self.transport,
            disaggregated=True,
            prefix_cache=self.prefix_cache,
            shared_prefix_cache=self.shared_prefix_cache,
        )


@dataclass(frozen=True, slots=True)
class SglangWorkerSpec:
    """An SGLang-style worker: its engine (`worker`) plus what its HTTP side and the router
    need."""

    worker: WorkerSpec
    secret: str  # the router credential: its path prefix (sglang_stack/gate.py)
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int = 0  # prefill: the router's `--prefill URL BOOTSTRAP_PORT`
    headroom: float = default_of(ServeConfig, "headroom")
    allow_undersized_pool: bool = False
    default_max_tokens: int = default_of(ServeConfig, "default_max_tokens")
    log_level: str = "warning"
    # How long one half of a pair waits for the other, or for word from it
    # (`sglang_stack.side`): decode holds the pages it reserved for a prefill that went quiet
    # this long, and the client waits this long for the 504.
    pair_timeout: float = 30.0  # seconds

    def __post_init__(self) -> None:
        if not self.pair_timeout > 0:
            raise ValueError(f"pair_timeout must be > 0 s, got {self.pair_timeout}")


SPEC_VERSION = 2  # another version is refused whole, before any of its fields is read
EXIT_BAD_SPEC = 2  # a child whose spec does not validate ends with this, before it binds
Spec = TypeVar("Spec", WorkerSpec, RouterSpec)


class SpecError(ValueError):
    """A spec that is unreadable, of another type or version, or has a bad field."""


def _what(cls: type) -> str:
    return f"{cls.__name__.removesuffix('Spec').lower()} spec"  # "worker spec"


def encode_spec(spec: WorkerSpec | RouterSpec) -> str:
    kind = f"kvfence.{type(spec).__name__}"
    return json.dumps(
        {"type": kind, "version": SPEC_VERSION, "body": dataclasses.asdict(spec)}, indent=2
    )


def decode_spec(cls: type[Spec], raw: str) -> Spec:
    what, kind = _what(cls), f"kvfence.{cls.__name__}"
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise SpecError(f"not a JSON {what}: {e}") from None
    if not isinstance(obj, dict) or set(obj) != {"type", "version", "body"}:
        raise SpecError(f"a {what} is an object with exactly 'type', 'version' and 'body'")
    if obj["type"] != kind or obj["version"] != SPEC_VERSION:
        raise SpecError(
            f"expected {kind} version {SPEC_VERSION}, got {obj['type']!r} "
            f"version {obj['version']!r}"
        )
    try:
        return build_checked(cls, obj["body"])
    except ValueError as e:  # MessageError or the spec's own checks
        raise SpecError(f"bad {what}: {e}") from None


def write_spec(spec: WorkerSpec | RouterSpec, path: Path) -> None:
    """Readable by the owner only: a spec names the role's addresses and files."""
    path.touch(mode=0o600)
    path.write_text(encode_spec(spec))


def read_spec(cls: type[Spec], path: Path) -> Spec:
    try:
        raw = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read the {_what(cls)} {path}: {e}") from None
    return decode_spec(cls, raw)


def spec_from_argv(cls: type[Spec], argv: list[str]) -> Spec:
    """A child entry's one argument, its spec file, read and validated."""
    if len(argv) != 1:
        entry = _what(cls).split()[0] + "_entry"
        raise SpecError(f"usage: python -m kvfence.hub.{entry} SPEC.json")
    return read_spec(cls, Path(argv[0]))
