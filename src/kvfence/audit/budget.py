"""The audit's hard caps on requests and time (shared by every check of one run)."""

from __future__ import annotations

import threading
import time

__all__ = ["Budget", "BudgetExhausted"]


class BudgetExhausted(RuntimeError):
    """The audit's hard cap on requests or time was reached; the check is inconclusive."""


class Budget:
    """Hard caps on how many requests the audit sends and for how long (thread-safe).

    Every HTTP request the audit makes is charged here *before* it is sent;
    once a cap is reached `charge` raises `BudgetExhausted` and nothing more
    is sent.
    """

    def __init__(self, max_requests: int = 5000, max_seconds: float = 900.0) -> None:
        if max_requests < 1 or max_seconds <= 0:
            raise ValueError("budget caps must be positive")
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        self._sent = 0
        self._started = time.monotonic()
        self._lock = threading.Lock()

    @property
    def sent(self) -> int:
        return self._sent

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.max_seconds - self.elapsed_s)

    def charge(self, n: int = 1) -> None:
        """Account for `n` requests about to be sent; raise when a cap is reached."""
        with self._lock:
            if self._sent + n > self.max_requests:
                raise BudgetExhausted(f"request budget of {self.max_requests} exhausted")
            if self.elapsed_s >= self.max_seconds:
                raise BudgetExhausted(f"time budget of {self.max_seconds:.0f} s exhausted")
            self._sent += n

    def timeout_for(self, wanted_s: float) -> float:
        """A per-request timeout that never runs past the time budget."""
        return max(0.001, min(wanted_s, self.remaining_s))
