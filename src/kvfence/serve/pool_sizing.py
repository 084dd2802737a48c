"""KV pool sizes per role: explicit pages or bytes, or sized from the memory available.

Given neither pages nor bytes, a role's pool is sized from the memory
available at start (after the weights are loaded), the way vLLM and SGLang
take a fraction of device memory: room for `DEFAULT_CONTEXTS` full-context
requests with the gate's headroom (at least 64 MiB), capped at
`memory_fraction` (default 10%) of the available memory. The line saying
what was chosen is printed at start, the capacity gate (I4) then verifies the
result, and `gate_fix_hint` names the flags that fix a failing gate. Torch-free:
the command line reads the defaults from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfence.engine.sizing import DEFAULT_HEADROOM, GateReport, MemoryBudget, pool_from_budget
from kvfence.kv.geometry import KVGeometry

DEFAULT_KV_BYTES = 64 * 1024 * 1024  # per role: the least a sized-from-memory pool gets
DEFAULT_KV_FRACTION = 0.1  # per role: the most of the available memory it takes by default
DEFAULT_CONTEXTS = 2  # full-context requests (x headroom) a default pool has room for
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
            why = (
                f"capped at {self.memory_fraction * 100:g}% of {available / _GIB:.1f} GiB available"
            )
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
