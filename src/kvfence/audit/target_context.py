"""One target's share of an audit run, for auditing separate targets concurrently.

Each target's thread gets its own `AuditContext`: the run's keys, caps,
alpha and progress, but its own random generator (seeded with the run's
seed, so a target's probes do not depend on what another thread drew) and
its own clients, whose requests are charged to the run's caps and counted
per target (a check's `requests_sent` is its own, not another thread's).
"""

from __future__ import annotations

from kvfence.audit.budget import Budget
from kvfence.audit.contract import AuditContext


class TargetBudget(Budget):
    """One target's view of the run's budget: every charge goes to the run's caps; `sent`
    counts this target's requests only (a check's count is its own, not another thread's)."""

    def __init__(self, run: Budget) -> None:
        super().__init__(run.max_requests, run.max_seconds)
        self._run = run

    @property
    def elapsed_s(self) -> float:
        return self._run.elapsed_s

    def charge(self, n: int = 1) -> None:
        self._run.charge(n)
        with self._lock:
            self._sent += n


def target_context(ctx: AuditContext) -> AuditContext:
    """A context for one target's thread: the run's keys, caps, alpha and progress; its own
    random generator (the run's seed) and clients counted against `TargetBudget`."""
    own = AuditContext(
        key_a=ctx.key_a,
        key_b=ctx.key_b,
        operator_key=ctx.operator_key,
        headroom=ctx.headroom,
        context_override=ctx.context_override,
        budget=TargetBudget(ctx.budget),
        seed=ctx.seed,
        progress=ctx.progress,
        quiet=ctx.quiet,
        request_timeout_s=ctx.request_timeout_s,
        alpha=ctx.alpha,
    )
    own.statistical = ctx.statistical
    return own
