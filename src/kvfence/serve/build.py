"""Wiring for the single-process server: checkpoint -> model -> LocalPipeline -> ServeConfig.

Pool sizes are given in pages or bytes per role; bytes are turned into whole
pages the way engines do (`pool_from_budget`). Given neither, a role's pool is
sized from the memory available at start (after the weights are loaded), the
way vLLM and SGLang take a fraction of device memory: room for
`DEFAULT_CONTEXTS` full-context requests with the gate's headroom (at least
64 MiB), capped at `memory_fraction` (default 10%) of the available memory.
The line saying what was chosen is printed at start, and the capacity gate
(I4) then verifies the result; `gate_fix_hint` names the flags that fix a
failing gate. The server's engine facts
(scrub policy, prefix-cache namespacing, transport) are read from the
pipeline's own configuration, so /server_info reports what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfence.engine.config import EngineConfig
from kvfence.engine.pipeline import LocalPipeline
from kvfence.engine.sizing import DEFAULT_HEADROOM, GateReport, MemoryBudget, pool_from_budget
from kvfence.faults import FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import ScrubPolicy
from kvfence.model.loader import LoadedModel, load_model
from kvfence.serve.config import ServeConfig

DEFAULT_KV_BYTES = 64 * 1024 * 1024  # per role: the least a sized-from-memory pool gets
DEFAULT_KV_FRACTION = 0.1  # per role: the most of the available memory it takes by default
DEFAULT_CONTEXTS = 2  # full-context requests (x headroom) a default pool has room for
SHARED_NAMESPACE = "shared"
ROLES = ("prefill", "decode")
_GIB = 1 << 30


def available_memory_bytes() -> int | None:
    """The memory this process can still use: MemAvailable, lowered to what the cgroup's
    limit leaves; None when the host does not say."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit != "max":
            found.append(max(0, int(limit) - int(used)))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


@dataclass(frozen=True, slots=True)
class RolePool:
    pages: int
    how: str  # one line for the start-up log: what was chosen and why


@dataclass(frozen=True, slots=True)
class PoolSizes:
    """KV pool size per role: pages, or a byte budget (at most one per role); neither = sized
    from the available memory (see the module docstring)."""

    prefill_pages: int | None = None
    decode_pages: int | None = None
    prefill_bytes: int | None = None
    decode_bytes: int | None = None
    memory_fraction: float = DEFAULT_KV_FRACTION

    def __post_init__(self) -> None:
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(
                f"the KV memory fraction must be in (0, 1], got {self.memory_fraction}"
            )

    def plan(
        self,
        role: str,
        geometry: KVGeometry,
        context_length: int | None = None,
        headroom: float = DEFAULT_HEADROOM,
        available: int | None = None,
    ) -> RolePool:
        pages = getattr(self, f"{role}_pages")
        budget = getattr(self, f"{role}_bytes")
        if pages is not None and budget is not None:
            raise ValueError(f"give either pages or bytes for the {role} pool, not both")
        if pages is not None:
            return RolePool(int(pages), f"{role} KV pool: {pages:,} pages (--kv-pages)")
        if budget is not None:
            n = pool_from_budget(geometry, MemoryBudget(kv_bytes=int(budget))).num_pages
            return RolePool(
                n, f"{role} KV pool: {n:,} pages from {int(budget):,} bytes (--kv-bytes)"
            )
        want = DEFAULT_KV_BYTES
        if context_length is not None:
            need = GateReport(0, context_length, headroom).required_tokens
            want = max(want, DEFAULT_CONTEXTS * need * geometry.bytes_per_token)
        why = f"room for {DEFAULT_CONTEXTS} contexts x headroom {headroom:g}, at least 64 MiB"
        if available is not None and int(available * self.memory_fraction) < want:
            want = int(available * self.memory_fraction)
            why = f"capped at {self.memory_fraction:.0%} of {available / _GIB:.1f} GiB available"
        # At least one page: an engine with no pool cannot start; the gate says what is short.
        n = max(1, pool_from_budget(geometry, MemoryBudget(kv_bytes=want)).num_pages)
        tokens = n * geometry.page_size
        return RolePool(
            n,
            f"{role} KV pool sized from memory: {n:,} pages = {tokens:,} tokens "
            f"({n * geometry.bytes_per_page / (1 << 20):,.0f} MiB; {why}; "
            "set with --kv-bytes, --kv-pages or --kv-memory-fraction)",
        )

    def pages(self, role: str, geometry: KVGeometry) -> int:
        """Pages for `role` without the context rule (the explicit sizes, or the 64 MiB floor)."""
        return self.plan(role, geometry).pages


def gate_fix_hint(report: GateReport, geometry: KVGeometry) -> str:
    """The `kvfence serve` flags that make a failing gate pass, with the numbers."""
    tokens = report.required_tokens
    pages = geometry.pages_for(tokens)
    return (
        f"flags that fix it: --kv-pages {pages} (or prefill={pages},decode={pages}), "
        f"--kv-bytes {pages * geometry.bytes_per_page} per role, a larger --kv-memory-fraction, "
        f"--context-length {int(report.pool_tokens // report.headroom)}, or --allow-undersized-pool"
    )


@dataclass(frozen=True, slots=True)
class ServerParts:
    loaded: LoadedModel
    pipeline: LocalPipeline
    config: ServeConfig
    geometry: KVGeometry
    sizing: tuple[str, ...]  # how each role's pool was sized, for the start-up log


def build_local(
    model_dir: str | Path,
    *,
    kind: str = "llama",
    context_length: int | None = None,
    pools: PoolSizes = PoolSizes(),
    page_size: int = 16,
    scrub: ScrubPolicy = ScrubPolicy.NONE,
    faults: FaultSet | None = None,
    prefix_cache: bool = True,
    shared_prefix_cache: bool = False,
    headroom: float = DEFAULT_HEADROOM,
    allow_undersized_pool: bool = False,
    lab_profile: str | None = None,
    default_max_tokens: int = 16,
) -> ServerParts:
    """Load the checkpoint and build a (not yet started) pipeline and the server's config."""
    loaded = load_model(model_dir, kind=kind)
    geometry = loaded.config.kv_geometry(page_size=page_size)
    ctx = context_length if context_length is not None else loaded.config.max_position_embeddings
    available = available_memory_bytes()  # measured once, after the weights are in memory
    prefill, decode = (pools.plan(r, geometry, ctx, headroom, available) for r in ROLES)
    engine = EngineConfig(
        prefill_pages=prefill.pages,
        decode_pages=decode.pages,
        page_size=page_size,
        context_length=ctx,
        scrub=scrub,
        prefix_cache=prefix_cache,
        shared_prefix_namespace=SHARED_NAMESPACE if shared_prefix_cache else None,
        eos_token_ids=loaded.tokenizer.eos_ids,
    )
    faults = faults or FaultSet()
    pipeline = LocalPipeline(loaded.model, geometry, engine, faults)
    config = ServeConfig(
        model_name=loaded.name,
        context_length=ctx,
        vocab_size=loaded.config.vocab_size,
        headroom=headroom,
        allow_undersized_pool=allow_undersized_pool,
        faults=faults,
        lab_profile=lab_profile,
        default_max_tokens=default_max_tokens,
        scrub_policy=engine.scrub.value,
        transport="in-process",
        disaggregated=False,
        prefix_cache=engine.prefix_cache,
        shared_prefix_cache=engine.shared_prefix_namespace is not None,
    )
    return ServerParts(loaded, pipeline, config, geometry, (prefill.how, decode.how))
