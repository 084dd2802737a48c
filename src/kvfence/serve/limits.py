"""Per-tenant admission limits: a noisy neighbour is answered 429, never queued.

Each tenant may have at most `max_concurrent` requests in flight and at most
`max_queued_tokens` prompt tokens waiting for their first token (queued or in
prefill). A request over either limit is refused at admission with HTTP 429
and `Retry-After`, before a room is made or anything is allocated, so a
flooder can fill neither the prefill queue nor the pools, and the other
tenants' requests keep their place. A prompt larger than `max_queued_tokens`
alone is admitted when the tenant has nothing else queued (otherwise it could
never be served).

Every tenant is limited unless the operator says otherwise: a bound left out
(or a tenant with no `limits` at all, generated tenants included) takes the
default derived from the engine's capacity (`default_limits`: one longest
request's prompt waiting, a quarter of the prefill pool in flight), `null`
lifts that one bound, and `"limits": "unlimited"` lifts them all. Limits
protect the *other* tenants, so the dev mode's single tenant is unlimited.

Refusals cost the server work too (reading and tokenizing a prompt that is
then refused with a 400, a 413 or a 429 over the queued tokens), so each such
refused request (`COSTLY_REFUSALS`) takes a token from its tenant's refusal
bucket (`refusal_burst` tokens, refilled at `refusals_per_s`); with the bucket
empty the tenant's next requests are answered 429 before their body is read,
so a flood of over-long prompts costs a bounded amount of work per second
whatever its rate. Counts live on the event loop only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, NoReturn, Protocol

from kvfence.serve.errors import ApiError

BOUND_FIELDS: Final = ("max_concurrent", "max_queued_tokens", "refusal_burst")
INT_FIELDS: Final = ("retry_after_s",)
LIMIT_FIELDS: Final = (*BOUND_FIELDS, *INT_FIELDS, "refusals_per_s")
UNLIMITED: Final = "unlimited"
DEFAULT: Final = "default"
# A tenant's default share of the prefill pool, and its least concurrency (`default_limits`).
POOL_SHARE: Final = 4
MIN_CONCURRENT: Final = 8
REFUSAL_BURST: Final = 20  # the default refusal bucket, refilled at `refusals_per_s`
# Refusals that cost the server work before they were refused: a prompt read and tokenized
# (over the context or the pool), a body read up to its size limit or held open too long. A
# field refused while parsing costs little and is not counted (a client's plain mistakes).
COSTLY_REFUSALS: Final = frozenset(
    {
        "context_length_exceeded",
        "pool_capacity_exceeded",
        "body_too_large",
        "body_timeout",
        "incomplete_body",
    }
)

Bound = int | None | Literal["default"]  # None: unbounded; "default": from the capacity

# A refusal's code and the words its message starts with: the sglang-router stack's edge
# gives a client its 429 back from them (the router hands a worker's 429 on as a 500, and a
# prefill worker's refusal reaches the client through decode, which keeps only the words).
LIMIT_CODE = "tenant_over_limit"
OVER_LIMIT = "tenant over its admission limit"
REFUSED_TOO_OFTEN = "tenant refused too often"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's limits as configured; `resolve` turns "default" bounds into numbers."""

    max_concurrent: Bound = DEFAULT
    max_queued_tokens: Bound = DEFAULT
    retry_after_s: int = 1
    refusal_burst: Bound = DEFAULT  # costly refused requests absorbed at once (None: no bucket)
    refusals_per_s: float = 2.0  # and per second after that

    def __post_init__(self) -> None:
        for name in BOUND_FIELDS:
            value = getattr(self, name)
            if value is None or value == DEFAULT:
                continue
            _check_int(name, value)
        for name in INT_FIELDS:
            _check_int(name, getattr(self, name))
        rate = self.refusals_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
            raise ValueError(f"limits.refusals_per_s must be a positive number, got {rate!r}")

    @classmethod
    def unlimited(cls) -> TenantLimits:
        return cls(max_concurrent=None, max_queued_tokens=None, refusal_burst=None)

    @property
    def is_unlimited(self) -> bool:
        return all(getattr(self, n) is None for n in BOUND_FIELDS)

    @property
    def is_default(self) -> bool:
        return self == TenantLimits()

    def resolve(self, defaults: TenantLimits) -> TenantLimits:
        """These limits with every "default" bound taken from `defaults`."""
        bounds = {n: getattr(defaults, n) for n in BOUND_FIELDS if getattr(self, n) == DEFAULT}
        return replace(self, **bounds)

    @classmethod
    def from_json(cls, obj: object) -> TenantLimits:
        if obj == UNLIMITED:
            return cls.unlimited()
        if not isinstance(obj, dict) or not set(obj) <= set(LIMIT_FIELDS):
            raise ValueError(
                f'limits must be "{UNLIMITED}" or an object with keys among {list(LIMIT_FIELDS)}'
            )
        if any(obj.get(n) == DEFAULT for n in BOUND_FIELDS):
            raise ValueError(f"limits: leave a bound out to take the default, not {DEFAULT!r}")
        return cls(**obj)

    def to_json(self) -> str | dict[str, Any]:
        """The tenants-file form: what `from_json` reads back to these same limits."""
        if self == TenantLimits.unlimited():
            return UNLIMITED
        base = TenantLimits()
        return {n: getattr(self, n) for n in LIMIT_FIELDS if getattr(self, n) != getattr(base, n)}


class PoolFacts(Protocol):
    """What the defaults are derived from (`config.Capacity` has both)."""

    @property
    def max_total_num_tokens(self) -> int: ...  # the smallest prefill pool, in tokens

    @property
    def edge_limit(self) -> int: ...  # the longest request admitted, prompt + max_tokens


def default_limits(capacity: PoolFacts) -> TenantLimits:
    """The bounds every tenant gets unless configured.

    max_queued_tokens: the longest request: one long prompt of a tenant at a time
    waits for prefill (short ones beside it), so no tenant queues prompt after
    prompt ahead of the others'. max_concurrent: as many longest requests as fit
    in a quarter of the prefill pool, and at least `MIN_CONCURRENT` (a client's
    usual parallelism; what of it is prompt still waits within the token bound).
    """
    longest = max(1, capacity.edge_limit)
    share = capacity.max_total_num_tokens // POOL_SHARE
    return TenantLimits(max(MIN_CONCURRENT, share // longest), longest, refusal_burst=REFUSAL_BURST)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"limits.{name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class Usage:
    in_flight: int = 0
    queued_tokens: int = 0
    refused: int = 0
    refusal_tokens: float = -1.0  # the refusal bucket; < 0: full, not yet drawn on
    refusal_stamp: float = 0.0


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
    """Every tenant's resolved limits and live usage.

    limits: as configured (a tenant not listed is limited by `defaults` alone);
    defaults: what a "default" bound means on this server (`default_limits`).
    """

    limits: Mapping[str, TenantLimits]
    defaults: TenantLimits = field(default_factory=TenantLimits.unlimited)
    clock: Callable[[], float] = time.monotonic
    usage: dict[str, Usage] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(getattr(self.defaults, n) == DEFAULT for n in BOUND_FIELDS):
            raise ValueError("AdmissionLimits.defaults must be numbers or None, not 'default'")
        self.limits = {t: lim.resolve(self.defaults) for t, lim in self.limits.items()}

    def of(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, self.defaults)

    def precheck(self, tenant: str) -> None:
        """Before the body is read: a tenant at its concurrency limit, or out of refusals,
        costs no parsing."""
        lim = self.of(tenant)
        use = self.usage.setdefault(tenant, Usage())
        wait = self._refusal_wait(lim, use)
        if wait is not None:
            use.refused += 1
            raise _too_many(
                f"{REFUSED_TOO_OFTEN}: more than {lim.refusal_burst} refused requests at "
                f"once or {lim.refusals_per_s:g} per second; retry after {wait} s",
                wait,
            )
        if isinstance(lim.max_concurrent, int) and use.in_flight >= lim.max_concurrent:
            self._refuse(
                lim, use, f"{use.in_flight} requests in flight, the limit is {lim.max_concurrent}"
            )

    def acquire(self, tenant: str, tokens: int) -> Slot:
        """Count the request in, or raise 429 naming the limit it would cross."""
        self.precheck(tenant)
        lim = self.of(tenant)
        use = self.usage[tenant]
        if (
            isinstance(lim.max_queued_tokens, int)
            and use.queued_tokens > 0
            and use.queued_tokens + tokens > lim.max_queued_tokens
        ):
            self._draw(lim, use)  # its prompt was read and tokenized: a refusal that cost work
            self._refuse(
                lim,
                use,
                f"{use.queued_tokens} prompt tokens waiting + {tokens} would exceed the "
                f"limit of {lim.max_queued_tokens}",
            )
        use.in_flight += 1
        use.queued_tokens += tokens
        return Slot(use, tokens)

    def refused(self, tenant: str | None, error: ApiError) -> None:
        """A request of this tenant was refused after costing work: it draws on the bucket.

        Only `COSTLY_REFUSALS` count (the limits' own 429s that cost work are counted by
        `acquire`), and never a request no tenant sent (401: no one to count it against).
        """
        if tenant is not None and error.code in COSTLY_REFUSALS:
            self.charge(tenant)

    def charge(self, tenant: str) -> None:
        """One refused request of this tenant that cost work draws on its bucket."""
        self._draw(self.of(tenant), self.usage.setdefault(tenant, Usage()))

    def _draw(self, lim: TenantLimits, use: Usage) -> None:
        if not isinstance(lim.refusal_burst, int):
            return  # no bucket
        self._refill(lim, use)
        use.refusal_tokens = max(0.0, use.refusal_tokens - 1.0)

    def _refill(self, lim: TenantLimits, use: Usage) -> None:
        now = self.clock()
        burst = float(lim.refusal_burst) if isinstance(lim.refusal_burst, int) else math.inf
        if use.refusal_tokens < 0:
            use.refusal_tokens = burst
        else:
            elapsed = max(0.0, now - use.refusal_stamp)
            use.refusal_tokens = min(burst, use.refusal_tokens + elapsed * lim.refusals_per_s)
        use.refusal_stamp = now

    def _refusal_wait(self, lim: TenantLimits, use: Usage) -> int | None:
        """Whole seconds until the refusal bucket holds a token again; None when it does."""
        if use.refusal_tokens < 0 or not isinstance(lim.refusal_burst, int):
            return None
        self._refill(lim, use)
        if use.refusal_tokens >= 1.0:
            return None
        return max(1, math.ceil((1.0 - use.refusal_tokens) / lim.refusals_per_s))

    @staticmethod
    def _refuse(lim: TenantLimits, use: Usage, over: str) -> NoReturn:
        use.refused += 1
        raise _too_many(
            f"{OVER_LIMIT}: {over}; retry after {lim.retry_after_s} s",
            lim.retry_after_s,
        )

    def report(self, tenant: str) -> dict[str, Any]:
        """One tenant's limits and live usage (a tenant sees only its own, I10)."""
        use = self.usage.get(tenant, Usage())
        lim = self.of(tenant)
        return {
            "tenant": tenant,
            "limits": {n: getattr(lim, n) for n in LIMIT_FIELDS},
            "in_flight": use.in_flight,
            "queued_tokens": use.queued_tokens,
            "refused": use.refused,
        }

    def report_all(self) -> list[dict[str, Any]]:
        """Every tenant's: for an operator's view, never a tenant's."""
        return [self.report(t) for t in sorted(set(self.limits) | set(self.usage))]


def _too_many(message: str, retry_after_s: int) -> ApiError:
    return ApiError(
        429,
        message,
        type="rate_limit_error",
        code=LIMIT_CODE,
        headers={"Retry-After": str(retry_after_s)},
    )
