"""What one PD worker process needs, torch-free: the CLI and the supervisor build it without
loading a model or a transport (tests/test_cli_lazy.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.engine.config import EngineConfig, default_of
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

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"a worker role is 'prefill' or 'decode', got {self.role!r}")
        if self.transport not in CROSS_PROCESS:
            raise ValueError(
                f"a cross-process transport is one of {', '.join(CROSS_PROCESS)}, "
                f"got {self.transport!r}"
            )
