"""How the audit rides out a target that is briefly unavailable, without counting it.

A router in front of slow workers answers 503 ("No available workers") while its health
checks lag, and a request on a loaded machine can outlive its timeout. Neither says anything
about isolation: a 503 is not a refusal of B's request, a timeout is not a slow prefill. So
`ProbeClient` sends such a request again, after a growing pause, a bounded number of times
and within a bounded total wait (`Pacing`), and every check sees only the answer that came
back in the end, with the availability failures before it on record (`ProbeResponse.
unavailable`). A request that stays unavailable past the pacing comes back failed, and the
checks' own rules make it inconclusive, never evidence either way.

Every retry is a request like any other: it is charged to the audit's `Budget` first, so
the hard caps on requests and time still hold.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["UNAVAILABLE_STATUSES", "Pacing", "RetryAllowance", "unavailable_reason"]

# 503: the server (or the router in front of it) says it cannot serve now, not that the
# request is wrong. Other 5xx are answers about the request and stay evidence for the checks
# that read them (a 500 on a forged transfer reference, a 502 from a gate).
UNAVAILABLE_STATUSES = frozenset({503})


# A router takes a worker it marked unhealthy back only after some health checks pass:
# vllm-router by default checks every 60 s and needs 2 in a row, so a decode worker that
# missed its checks under load leaves the fleet answering 503 "0 decode" for up to two
# minutes. The default pacing outlasts that (1 + 2 + 4 + 8 + 16 x 8 = 143 s of pauses for one
# request), within the per-client allowance.
DEFAULT_RETRIES = 12
DEFAULT_MAX_PAUSE_S = 16.0


@dataclass(frozen=True, slots=True)
class Pacing:
    """The retry policy for availability failures.

    ``retries``: further tries of one request; ``backoff_s``: the first pause, doubled before
    each next try up to ``max_pause_s``; ``max_wait_s``: the most one client spends, over the
    whole audit, on requests that came back unavailable and the pauses after them (a target
    that stays down is reported, not waited on forever). ``retries=0`` turns retrying off.
    """

    retries: int = DEFAULT_RETRIES
    backoff_s: float = 1.0
    max_wait_s: float = 180.0
    max_pause_s: float = DEFAULT_MAX_PAUSE_S

    def __post_init__(self) -> None:
        if min(self.retries, self.backoff_s, self.max_wait_s, self.max_pause_s) < 0:
            raise ValueError("pacing needs retries, backoff_s, max_wait_s and max_pause_s >= 0")

    def pause_s(self, attempt: int) -> float:
        """The pause before try `attempt + 1` (attempt 0 is the first send)."""
        return min(self.backoff_s * (2**attempt), self.max_pause_s)


def unavailable_reason(status: int | None, error: str | None) -> str | None:
    """Why an answer says the target was unavailable (None: it is an answer to judge)."""
    if status is None:
        return f"no HTTP answer: {error or 'no reason given'}"
    if status in UNAVAILABLE_STATUSES:
        return f"HTTP {status}"
    return None


class RetryAllowance:
    """What is left of one client's `Pacing.max_wait_s` (thread-safe)."""

    def __init__(self, pacing: Pacing) -> None:
        self.pacing = pacing
        self._spent_s = 0.0
        self._retried = 0
        self._lock = threading.Lock()

    @property
    def spent_s(self) -> float:
        return self._spent_s

    @property
    def retried(self) -> int:
        return self._retried

    def spend(self, seconds: float) -> None:
        """One unavailable try and the pause after it, before the request is sent again."""
        with self._lock:
            self._spent_s += seconds
            self._retried += 1

    def allows(self, attempt: int) -> bool:
        """Whether try `attempt + 1` may follow an unavailable try `attempt`."""
        if attempt >= self.pacing.retries:
            return False
        return self._spent_s + self.pacing.pause_s(attempt) <= self.pacing.max_wait_s

    def to_json(self) -> dict[str, float | int]:
        """For a check's evidence: how often the target was unavailable and what it cost."""
        return {
            "retried": self._retried,
            "spent_s": round(self._spent_s, 2),
            "retries_per_request": self.pacing.retries,
            "max_wait_s": self.pacing.max_wait_s,
        }
