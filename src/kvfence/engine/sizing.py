"""Pool sizing from a memory budget, and the capacity gate (invariant I4).

The pool size is not a setting: real engines derive it at start-up from the
memory left after weights (SGLang: a static fraction of device memory minus
weights; vLLM: a utilisation fraction, or on CPU an explicit KV byte budget).
The context length *is* a setting. The gate forces the two to agree:
`pool_tokens >= context_length x headroom`, or the engine does not start.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.kv.geometry import KVGeometry

DEFAULT_HEADROOM = 1.25


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """Either an explicit KV byte budget, or device memory x fraction minus weights."""

    kv_bytes: int | None = None
    device_bytes: int | None = None
    weight_bytes: int = 0
    fraction: float = 0.9

    def __post_init__(self) -> None:
        if (self.kv_bytes is None) == (self.device_bytes is None):
            raise ValueError("give exactly one of kv_bytes or device_bytes")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        for name in ("kv_bytes", "device_bytes", "weight_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def kv_budget_bytes(self) -> int:
        if self.kv_bytes is not None:
            return self.kv_bytes
        assert self.device_bytes is not None
        return max(0, int(self.device_bytes * self.fraction) - self.weight_bytes)


@dataclass(frozen=True, slots=True)
class PoolSize:
    num_pages: int
    page_size: int
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def pool_from_budget(geometry: KVGeometry, budget: MemoryBudget) -> PoolSize:
    """Whole pages that fit the budget (rounded down, as engines do)."""
    pages = budget.kv_budget_bytes // geometry.bytes_per_page
    return PoolSize(
        num_pages=pages, page_size=geometry.page_size, bytes_per_token=geometry.bytes_per_token
    )


class CapacityGateError(Exception):
    """The pool cannot hold the advertised context. The message names both numbers and the fixes."""

    def __init__(self, report: GateReport) -> None:
        super().__init__(report.message())
        self.report = report


@dataclass(frozen=True, slots=True)
class GateReport:
    pool_tokens: int
    context_length: int
    headroom: float = DEFAULT_HEADROOM

    def __post_init__(self) -> None:
        if self.context_length <= 0:
            raise ValueError(f"context_length must be positive, got {self.context_length}")
        if self.headroom < 1.0:
            raise ValueError(
                f"headroom below 1.0 cannot hold one full-context request, got {self.headroom}"
            )
        if self.pool_tokens < 0:
            raise ValueError(f"pool_tokens must be >= 0, got {self.pool_tokens}")

    @property
    def required_tokens(self) -> int:
        return int(-(-self.context_length * self.headroom // 1))

    @property
    def passed(self) -> bool:
        return self.pool_tokens >= self.required_tokens

    @property
    def margin_tokens(self) -> int:
        """Positive: spare tokens above the requirement; negative: the shortfall."""
        return self.pool_tokens - self.required_tokens

    @property
    def ratio(self) -> float:
        return self.pool_tokens / self.context_length

    def message(self) -> str:
        head = (
            f"KV pool {self.pool_tokens:,} tokens vs context {self.context_length:,} x headroom "
            f"{self.headroom:g} = {self.required_tokens:,} required (pool/context = {self.ratio:.3f})"
        )
        if self.passed:
            return f"capacity gate PASS: {head}; margin {self.margin_tokens:,} tokens"
        return (
            f"capacity gate FAIL: {head}; short by {-self.margin_tokens:,} tokens. Fixes: "
            f"(1) give the KV pool more memory (>= {self.required_tokens:,} tokens) or lower the "
            f"context length to <= {int(self.pool_tokens // self.headroom):,}; or (2) serve with "
            f"--allow-undersized-pool, which rejects prompt + max_tokens > {self.pool_tokens:,} "
            f"with HTTP 400 at the edge before anything is allocated."
        )


@dataclass(frozen=True, slots=True)
class GateDecision:
    """What the engine may do: start, and with which edge limit on prompt + max_tokens."""

    report: GateReport
    edge_limit: int  # the router rejects prompt + max_tokens above this with HTTP 400
    undersized: bool


def capacity_gate(
    pool_tokens: int,
    context_length: int,
    *,
    headroom: float = DEFAULT_HEADROOM,
    allow_undersized: bool = False,
) -> GateDecision:
    """Pass, or raise `CapacityGateError`; with `allow_undersized` the edge limit becomes the pool."""
    report = GateReport(pool_tokens=pool_tokens, context_length=context_length, headroom=headroom)
    if report.passed:
        return GateDecision(report=report, edge_limit=context_length, undersized=False)
    if not allow_undersized:
        raise CapacityGateError(report)
    return GateDecision(report=report, edge_limit=min(context_length, pool_tokens), undersized=True)
