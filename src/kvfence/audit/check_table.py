"""The runbook's checks, in the order it runs them: each name with the class that runs it.

Order: capacity → boundary → canary → lease_reuse (asked for by name only) →
noninterference → latency → prefix_sharing → counters (compare; its snapshot is taken
first, so the leases lease_reuse let run out show there) → transfer_reference.

Each class is imported when its check is first loaded, not with this module: the
statistical checks pull in scipy (a second or more on a busy machine), and a check
whose import fails must come back INCONCLUSIVE on its own (fail closed) instead of
taking the whole audit down. The imports are still written out, one loader per check,
so a renamed class or module fails the type check and the layering tests see them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfence.audit.contract import Check

CheckLoader = Callable[[], type[Check]]


def _capacity() -> type[Check]:
    from kvfence.audit.checks.capacity.check import CapacityCheck

    return CapacityCheck


def _boundary() -> type[Check]:
    from kvfence.audit.checks.boundary.check import BoundaryCheck

    return BoundaryCheck


def _canary() -> type[Check]:
    from kvfence.audit.checks.canary.check import CanaryCheck

    return CanaryCheck


def _lease_reuse() -> type[Check]:
    from kvfence.audit.checks.canary.lease_reuse import LeaseReuseCheck

    return LeaseReuseCheck


def _noninterference() -> type[Check]:
    from kvfence.audit.checks.noninterference.check import NoninterferenceCheck

    return NoninterferenceCheck


def _latency() -> type[Check]:
    from kvfence.audit.checks.latency.check import LatencyCheck

    return LatencyCheck


def _prefix_sharing() -> type[Check]:
    from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck

    return PrefixSharingCheck


def _counters() -> type[Check]:
    from kvfence.audit.checks.counters.check import CountersCheck

    return CountersCheck


def _transfer_reference() -> type[Check]:
    from kvfence.audit.checks.transfer_reference.check import TransferReferenceCheck

    return TransferReferenceCheck


# Every check's name, as `--check` takes it and the reports show it, with its loader.
CHECKS: tuple[tuple[str, CheckLoader], ...] = (
    ("capacity", _capacity),
    ("boundary", _boundary),
    ("canary", _canary),
    ("lease_reuse", _lease_reuse),
    ("noninterference", _noninterference),
    ("latency", _latency),
    ("prefix_sharing", _prefix_sharing),
    ("counters", _counters),
    ("transfer_reference", _transfer_reference),
)
ALL_CHECKS: tuple[str, ...] = tuple(name for name, _ in CHECKS)
# Checks run only when `--checks` names them. lease_reuse fills a P/D fleet's pools with
# long decodes for minutes to make leases run out, it can prove a leak but never a pass
# (INCONCLUSIVE otherwise, which would block every deploy it ran in), and it needs a
# router that lists its prefill and decode nodes.
OPT_IN_CHECKS: tuple[str, ...] = ("lease_reuse",)
DEFAULT_CHECKS: tuple[str, ...] = tuple(n for n in ALL_CHECKS if n not in OPT_IN_CHECKS)
# The main job's checks: its two targets are kvfence's hub, which makes every transfer room
# itself and refuses a client's transfer fields (vLLM's or SGLang's) with a 400, lab switch
# or not: transfer_reference passes on both and tells the demo nothing (its lab proof is the
# sglang-router stack under `decode-trusts-bootstrap`).
EMBEDDED_CHECKS: tuple[str, ...] = tuple(n for n in DEFAULT_CHECKS if n != "transfer_reference")
# Checks that never overlap any other audit traffic: latency and prefix sharing test
# durations (TTFT), and noninterference's verdict rests on how A's load interleaves with
# B's repeats (on the demo's lab, 9 of 10 repeats must land on A's data; with another
# target's checks on the same cores, 7 of 9 were seen at load 22): another target's
# traffic would change what they measure.
TIMED_CHECKS: tuple[str, ...] = ("noninterference", "latency", "prefix_sharing")


def in_run_order(names: Sequence[str]) -> tuple[str, ...]:
    """`names` in the runbook's order; a name that is no check is a ValueError naming the choices
    (before any request is sent, so a typo never runs half an audit)."""
    unknown = [name for name in names if name not in ALL_CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r}; choose from {', '.join(ALL_CHECKS)}")
    return tuple(n for n in ALL_CHECKS if n in names)


class CheckUnavailable(Exception):
    """A known check that cannot be loaded (its module or a dependency is missing or broken)."""


def check_class(name: str) -> type[Check]:
    """The class of the check called `name`; raises `CheckUnavailable` when it cannot load."""
    loader = dict(CHECKS).get(name)
    if loader is None:
        raise ValueError(f"unknown check {name!r}; choose from {', '.join(ALL_CHECKS)}")
    try:
        return loader()
    except ImportError as e:  # ModuleNotFoundError included: a dependency not installed
        raise CheckUnavailable(f"cannot import the {name} check: {e}") from e


def load_check(name: str) -> Check:
    """Instantiate the check called `name`; raises `CheckUnavailable` when it cannot load.

    A check that cannot load never counts as skipped: the audit reports it
    INCONCLUSIVE, which blocks a deploy (fail closed: unknown is never a pass).
    """
    return check_class(name)()


def preload_checks(names: Sequence[str]) -> None:
    """Import the checks `names` now (scipy and the statistics, a second or more on a busy
    machine), e.g. while the servers to audit start; one that fails to import is reported
    by `load_check` when its turn comes (fail closed), not here."""
    for name in names:
        try:
            check_class(name)
        except (CheckUnavailable, ValueError):
            continue
