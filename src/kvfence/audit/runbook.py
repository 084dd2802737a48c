"""The runbook: every check, in order, on every target, bounded and with progress.

Order: counters snapshot → capacity → boundary → canary → noninterference →
latency → prefix_sharing → counters (compare). Checks that are not part of
this build are reported SKIPPED with a reason; a target whose engine cannot
be identified gets INCONCLUSIVE for every check (fail closed).

With `separate_targets=True` (the caller vouches that the targets are
separate engines: no process, pool or cache in common, like the embedded
demo's two server trees) the targets are audited concurrently where timing
decides nothing: detection, facts, capacity, boundary and canary (verdicts
read from status codes and texts) run on all targets at once; the checks in
`TIMED_CHECKS` then run on one target at a time with no other audit
traffic, exactly as in the sequential order. Each
target then has its own random generator (seeded with the run's seed) and
its own request count, so its probes do not depend on the other threads.

`audit_server(url, key_a, key_b)` is the hook for `kvfence audit` without
`--target`: whoever starts the embedded server passes its URL and keys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from kvfence.audit.base import STATISTICAL_CHECKS, Budget, CheckResult, JSONValue, Verdict
from kvfence.audit.check_table import (
    DEFAULT_CHECKS,
    TIMED_CHECKS,
    CheckUnavailable,
    in_run_order,
    load_check,
)
from kvfence.audit.checks.counters.check import CountersCheck
from kvfence.audit.contract import AuditContext, Check, run_check
from kvfence.audit.run_record import AuditRun, TargetSummary
from kvfence.audit.target_context import target_context
from kvfence.audit.target_names import TargetSpec, as_specs
from kvfence.audit.targets.base import Target
from kvfence.audit.targets.registry import DetectionError, make_target


def loaded_or_inconclusive(name: str, url: str) -> Check | CheckResult:
    """The check, or the INCONCLUSIVE result that stands for it when it cannot load."""
    try:
        return load_check(name)
    except CheckUnavailable as e:
        return _result(name, url, Verdict.INCONCLUSIVE, f"check could not be loaded: {e}")


def run_audit(
    targets: Sequence[str | TargetSpec],
    ctx: AuditContext,
    *,
    engine: str = "auto",
    checks: Sequence[str] = DEFAULT_CHECKS,
    on_result: Callable[[CheckResult], None] | None = None,
    separate_targets: bool = False,
) -> AuditRun:
    """Run `checks` on every target (a URL, or a `TargetSpec` with the name the reports show);
    every request bounded by `ctx.budget`.

    `separate_targets`: the targets share nothing (see the module docstring), so the
    untimed checks of all targets run concurrently; results keep the sequential order.
    """
    ordered = in_run_order(checks)
    specs = as_specs(targets)
    ctx.statistical = tuple(n for n in ordered if n in STATISTICAL_CHECKS)  # alpha's split
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    results: list[CheckResult] = []

    def collect(res: CheckResult) -> None:
        results.append(res)
        if on_result is not None:
            on_result(res)

    if separate_targets and len(specs) > 1:
        summaries, results = _audit_separate(specs, engine, ordered, ctx, on_result)
    else:
        summaries = _audit_in_turn(specs, engine, ordered, ctx, _named(specs, collect))
    return AuditRun(
        targets=summaries,
        results=results,
        checks=ordered,
        started_at=started,
        duration_s=time.monotonic() - t0,
        requests_sent=ctx.budget.sent,
        settings=_settings(engine, ctx),
    )


def _audit_in_turn(
    specs: Sequence[TargetSpec],
    engine: str,
    ordered: tuple[str, ...],
    ctx: AuditContext,
    emit: Callable[[CheckResult], None],
) -> list[TargetSummary]:
    """One target after another, each through every check in order."""
    summaries: list[TargetSummary] = []
    for spec in specs:
        summary, target = _resolve_counted(spec, engine, ctx)
        summaries.append(summary)
        if target is None:
            _not_audited(summary, ordered, emit)
            continue
        _audit_target(target, ordered, ctx, summary, emit)
    return summaries


def _settings(engine: str, ctx: AuditContext) -> dict[str, JSONValue]:
    return {
        "engine": engine,
        "headroom": ctx.headroom,
        "context_override": ctx.context_override,
        "seed": ctx.seed,
        "alpha": ctx.alpha,
        "alpha_per_check": {n: ctx.alpha_for(n) for n in ctx.statistical},
        "max_requests": ctx.budget.max_requests,
        "max_seconds": ctx.budget.max_seconds,
    }


def _resolve_counted(
    spec: TargetSpec, engine: str, ctx: AuditContext
) -> tuple[TargetSummary, Target | None]:
    sent0 = ctx.budget.sent
    summary, target = _resolve(spec, engine, ctx)
    summary.requests_sent = ctx.budget.sent - sent0
    return summary, target


def _not_audited(
    summary: TargetSummary, ordered: tuple[str, ...], emit: Callable[[CheckResult], None]
) -> None:
    # The reason is the target's (reported once with it), not each check's: a dead target
    # read as seven copies of one error.
    why = "not audited: the target was not identified (the reason is given once, below)"
    for name in ordered:
        emit(_result(name, summary.url, Verdict.INCONCLUSIVE, why))


def _resolve(
    spec: TargetSpec, engine: str, ctx: AuditContext
) -> tuple[TargetSummary, Target | None]:
    url = spec.url
    client = ctx.client_for_url(url, "a")
    try:
        target = make_target(url, engine, client, known_by=spec.engine_known_by)
    except DetectionError as e:
        return TargetSummary(url, None, None, error=str(e), name=spec.name), None
    except Exception as e:  # budget, network: the target cannot be vouched for
        error = f"{type(e).__name__}: {e}"
        return TargetSummary(url, None, None, error=error, name=spec.name), None
    return TargetSummary(url, target.engine, target.detected_by, name=spec.name), target


def _audit_target(
    target: Target,
    ordered: tuple[str, ...],
    ctx: AuditContext,
    summary: TargetSummary,
    emit: Callable[[CheckResult], None],
) -> None:
    counters = _prepare_target(target, ordered, ctx, summary)
    _run_checks(target, summary.label, ordered, ctx, counters, emit)
    ctx.progress(f"{summary.label}: done", 1.0)


def _prepare_target(
    target: Target, ordered: tuple[str, ...], ctx: AuditContext, summary: TargetSummary
) -> Check | CheckResult | None:
    """Facts, the B client's configuration and the counter snapshot; returns the counters
    check (snapshot taken) or what stands for it."""
    sent0 = ctx.budget.sent
    try:
        summary.facts = target.facts(ctx.client(target, "a")).to_json()
        target.configure_client(ctx.client(target, "b"))
    except Exception as e:  # fail closed; each check will report it again
        summary.error = f"facts not readable: {type(e).__name__}: {e}"
    counters = loaded_or_inconclusive("counters", target.url) if "counters" in ordered else None
    if isinstance(counters, CountersCheck):
        try:
            counters.snapshot(ctx, target)
        except Exception as e:
            summary.error = f"counter snapshot failed: {type(e).__name__}: {e}"
    summary.requests_sent += ctx.budget.sent - sent0
    return counters


def _run_checks(
    target: Target,
    label: str,
    names: tuple[str, ...],
    ctx: AuditContext,
    counters: Check | CheckResult | None,
    emit: Callable[[CheckResult], None],
) -> None:
    for i, name in enumerate(names):
        ctx.progress(f"{label}: {name}", i / len(names))
        check = counters if name == "counters" else loaded_or_inconclusive(name, target.url)
        if isinstance(check, CheckResult):
            emit(check)  # fail closed: a check that cannot run is not a skip
        elif check is not None:
            emit(run_check(check, ctx, target))


def _audit_separate(
    specs: Sequence[TargetSpec],
    engine: str,
    ordered: tuple[str, ...],
    ctx: AuditContext,
    on_result: Callable[[CheckResult], None] | None,
) -> tuple[list[TargetSummary], list[CheckResult]]:
    """Untimed checks on every target at once, then the timed ones one target at a time,
    then the counters; the results come back in the sequential order (target, check)."""
    contexts = [target_context(ctx) for _ in specs]
    lock = threading.Lock()
    results: list[CheckResult] = []

    def collect(res: CheckResult) -> None:
        with lock:
            results.append(res)
            if on_result is not None:
                on_result(res)

    keep = _named(specs, collect)

    untimed = tuple(n for n in ordered if n not in TIMED_CHECKS and n != "counters")
    timed = tuple(n for n in ordered if n in TIMED_CHECKS)
    last = ("counters",) if "counters" in ordered else ()

    def first_phase(i: int) -> Phase:
        summary, target = _resolve_counted(specs[i], engine, contexts[i])
        if target is None:
            _not_audited(summary, ordered, keep)
            return summary, None, None
        counters = _prepare_target(target, ordered, contexts[i], summary)
        _run_checks(target, summary.label, untimed, contexts[i], counters, keep)
        return summary, target, counters

    try:
        with ThreadPoolExecutor(max_workers=len(specs), thread_name_prefix="audit-target") as pool:
            phase = list(pool.map(first_phase, range(len(specs))))
        _one_at_a_time(phase, contexts, timed, last, keep)
    finally:
        for own in contexts:
            own.close()
    rank = {spec.url: i for i, spec in reversed(list(enumerate(specs)))}
    results.sort(key=lambda r: (rank.get(r.target, len(specs)), ordered.index(r.check)))
    return [summary for summary, _, _ in phase], results


Phase = tuple[TargetSummary, Target | None, Check | CheckResult | None]


def _one_at_a_time(
    phase: list[Phase],
    contexts: list[AuditContext],
    timed: tuple[str, ...],
    last: tuple[str, ...],
    keep: Callable[[CheckResult], None],
) -> None:
    """The timed checks, one target at a time, then every target's counters."""
    for (summary, target, counters), own in zip(phase, contexts, strict=True):
        if target is not None:  # nothing else of the audit's runs beside a timed check
            _run_checks(target, summary.label, timed, own, counters, keep)
    for (summary, target, counters), own in zip(phase, contexts, strict=True):
        if target is not None:
            _run_checks(target, summary.label, last, own, counters, keep)
            own.progress(f"{summary.label}: done", 1.0)


def _named(
    specs: Sequence[TargetSpec], sink: Callable[[CheckResult], None]
) -> Callable[[CheckResult], None]:
    """`sink` after each result is given its target's name (a URL's first name)."""
    names = {spec.url: spec.name for spec in reversed(specs)}

    def stamp(res: CheckResult) -> None:
        res.target_name = names.get(res.target, res.target)
        sink(res)

    return stamp


def _result(name: str, url: str, verdict: Verdict, summary: str) -> CheckResult:
    return CheckResult(check=name, target=url, verdict=verdict, summary=summary)


def audit_server(
    url: str,
    key_a: str | None,
    key_b: str | None,
    *,
    engine: str = "kvfence",
    checks: Sequence[str] = DEFAULT_CHECKS,
    headroom: float = 1.25,
    seed: int = 0,
    budget: Budget | None = None,
    progress: Callable[[str, float | None], None] | None = None,
    operator_key: str | None = None,
) -> AuditRun:
    """Audit one already-started server (the embedded default's hook for `kvfence audit`)."""
    ctx = AuditContext(
        key_a=key_a,
        key_b=key_b,
        operator_key=operator_key,
        headroom=headroom,
        seed=seed,
        budget=budget or Budget(),
        quiet=progress is None,
    )
    if progress is not None:
        ctx.progress = progress
    with ctx.open():
        return run_audit([url], ctx, engine=engine, checks=checks)
