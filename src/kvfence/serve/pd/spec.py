"""What one PD worker process needs, torch-free: the CLI and the supervisor build it without
loading a model or a transport (tests/test_cli_lazy.py).

The `--disaggregated` supervisor builds each worker's `WorkerSpec` once and hands it over as
one JSON document (`write_worker_spec`); the worker validates every field on receipt
(`read_worker_spec`) with the same strict rules as a control message, and refuses a document
of another type or version before it loads anything.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kvfence.engine.config import EngineConfig, default_of
from kvfence.engine.messages import build_checked
from kvfence.kv.scrub import ScrubPolicy
from kvfence.serve.pool_sizing import DEFAULT_KV_FRACTION

# Every registered transport but the in-process one joins two processes (mooncake and nixl
# need the `pd` extra). Declared here, torch-free, so the `--disaggregated` supervisor and the
# router role parse their options without importing the transports;
# tests/transfer/test_transport_protocol.py holds it equal to the registry.
CROSS_PROCESS = ("tcp", "shm", "mooncake", "nixl")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything one worker process needs; built from `kvfence serve --role …` options."""

    role: str  # "prefill" or "decode"
    model_dir: str
    model_kind: str
    inbox: str  # the control address this worker binds, e.g. tcp://10.0.0.2:7001
    router: str  # the router's control inbox
    pages: int | None = None  # this role's KV pool in pages, or
    kv_bytes: int | None = None  # a byte budget (whole pages, rounded down); default: from memory
    kv_memory_fraction: float = DEFAULT_KV_FRACTION
    page_size: int = default_of(EngineConfig, "page_size")
    context_length: int | None = None
    scrub: str = ScrubPolicy.NONE.value
    prefix_cache: bool = True
    shared_prefix_namespace: str | None = None
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
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")


SPEC_TYPE = "kvfence.WorkerSpec"
SPEC_VERSION = 1


class SpecError(ValueError):
    """A worker spec that is unreadable, of another type or version, or has a bad field."""


def encode_worker_spec(spec: WorkerSpec) -> str:
    return json.dumps(
        {"type": SPEC_TYPE, "version": SPEC_VERSION, "body": dataclasses.asdict(spec)}, indent=2
    )


def decode_worker_spec(raw: str) -> WorkerSpec:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise SpecError(f"not a JSON worker spec: {e}") from None
    if not isinstance(obj, dict) or set(obj) != {"type", "version", "body"}:
        raise SpecError("a worker spec is an object with exactly 'type', 'version' and 'body'")
    if obj["type"] != SPEC_TYPE or obj["version"] != SPEC_VERSION:
        raise SpecError(
            f"expected {SPEC_TYPE} version {SPEC_VERSION}, got {obj['type']!r} "
            f"version {obj['version']!r}"
        )
    try:
        return build_checked(WorkerSpec, obj["body"])
    except ValueError as e:  # MessageError or WorkerSpec's own checks
        raise SpecError(f"bad worker spec: {e}") from None


def write_worker_spec(spec: WorkerSpec, path: Path) -> None:
    """Readable by the owner only: the spec names the role's addresses."""
    path.touch(mode=0o600)
    path.write_text(encode_worker_spec(spec))


def read_worker_spec(path: Path) -> WorkerSpec:
    try:
        raw = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read the worker spec {path}: {e}") from None
    return decode_worker_spec(raw)
