"""Per-tenant admission limits: a noisy neighbour is answered 429, never queued.

Each tenant may have at most `max_concurrent` requests in flight and at most
`max_queued_tokens` prompt tokens waiting for their first token (queued or in
prefill). A request over either limit is refused at admission with HTTP 429
and `Retry-After`, before a room is made or anything is allocated, so a
flooder can fill neither the prefill queue nor the pools, and the other
tenants' requests keep their place. A prompt larger than `max_queued_tokens`
alone is admitted when the tenant has nothing else queued (otherwise it could
never be served). Limits come from the tenants file; a tenant without them is
unlimited. Counts live on the event loop only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvfence.serve.errors import ApiError

LIMIT_FIELDS = ("max_concurrent", "max_queued_tokens", "retry_after_s")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_concurrent: int | None = None
    max_queued_tokens: int | None = None
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in LIMIT_FIELDS:
            value = getattr(self, name)
            if value is None and name != "retry_after_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits.{name} must be a positive integer, got {value!r}")

    @property
    def unlimited(self) -> bool:
        return self.max_concurrent is None and self.max_queued_tokens is None

    @classmethod
    def from_json(cls, obj: object) -> TenantLimits:
        if not isinstance(obj, dict) or not set(obj) <= set(LIMIT_FIELDS):
            raise ValueError(f"limits must be an object with keys among {list(LIMIT_FIELDS)}")
        return cls(**obj)

    def to_json(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_FIELDS}


@dataclass(slots=True)
class Usage:
    in_flight: int = 0
    queued_tokens: int = 0
    refused: int = 0


@dataclass(slots=True)
class Slot:
    """One admitted request's share of its tenant's usage; each part is given back once."""

    usage: Usage
    tokens: int
    queued: bool = True
    live: bool = True

    def prefilled(self) -> None:
        """The first token arrived: the prompt no longer waits."""
        if self.queued:
            self.queued = False
            self.usage.queued_tokens -= self.tokens

    def release(self) -> None:
        self.prefilled()
        if self.live:
            self.live = False
            self.usage.in_flight -= 1


@dataclass(slots=True)
class AdmissionLimits:
    limits: Mapping[str, TenantLimits]
    usage: dict[str, Usage] = field(default_factory=dict)

    def precheck(self, tenant: str) -> None:
        """Before the body is read: a tenant at its concurrency limit costs no parsing."""
        lim = self.limits.get(tenant, TenantLimits())
        use = self.usage.setdefault(tenant, Usage())
        if lim.max_concurrent is not None and use.in_flight >= lim.max_concurrent:
            self._refuse(
                lim, use, f"{use.in_flight} requests in flight, the limit is {lim.max_concurrent}"
            )

    def acquire(self, tenant: str, tokens: int) -> Slot:
        """Count the request in, or raise 429 naming the limit it would cross."""
        self.precheck(tenant)
        lim = self.limits[tenant] if tenant in self.limits else TenantLimits()
        use = self.usage[tenant]
        if (
            lim.max_queued_tokens is not None
            and use.queued_tokens > 0
            and use.queued_tokens + tokens > lim.max_queued_tokens
        ):
            self._refuse(
                lim,
                use,
                f"{use.queued_tokens} prompt tokens waiting + {tokens} would exceed the "
                f"limit of {lim.max_queued_tokens}",
            )
        use.in_flight += 1
        use.queued_tokens += tokens
        return Slot(use, tokens)

    @staticmethod
    def _refuse(lim: TenantLimits, use: Usage, over: str) -> NoReturn:
        use.refused += 1
        raise ApiError(
            429,
            f"tenant over its admission limit: {over}; retry after {lim.retry_after_s} s",
            type="rate_limit_error",
            code="tenant_over_limit",
            headers={"Retry-After": str(lim.retry_after_s)},
        )

    def report(self, tenant: str) -> dict[str, Any]:
        """One tenant's limits and live usage (a tenant sees only its own, I10)."""
        use = self.usage.get(tenant, Usage())
        return {
            "tenant": tenant,
            "limits": self.limits.get(tenant, TenantLimits()).to_json(),
            "in_flight": use.in_flight,
            "queued_tokens": use.queued_tokens,
            "refused": use.refused,
        }

    def report_all(self) -> list[dict[str, Any]]:
        """Every tenant's: for an operator's view, never a tenant's."""
        return [self.report(t) for t in sorted(set(self.limits) | set(self.usage))]
