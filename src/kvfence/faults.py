"""The one registry of fault switches.

Each switch disables exactly one defence and re-creates a published isolation
bug, except `poisoned-sampling`, which injects one request's failure (sampling
raises for a request seeded with `POISON_SEED` + k from its token k on) so that the defence that
contains it, per-request isolation inside a shared step, can be shown working
or missing on a live server. All are off by default. The engine only ever *reads* a frozen `FaultSet`;
switches are set solely through explicit lab configuration (``kvfence lab`` or
``kvfence serve --lab-fault``) and every active switch is listed in
``/server_info`` so an audit can never mistake a lab server for production.

The lab's holds travel the same way: ``hold=FOLDER`` turns no defence off, it
lets a test park a granted KV transfer and decode's step at an exact point
(transfer/lab_holds.py), so no lab hook is switched any other way.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


class Fault(enum.Enum):
    """A fault switch. The value is the public (CLI / server_info) name."""

    UNDERSIZED_POOL = "undersized-pool"
    ABORT_NOT_TERMINAL = "abort-not-terminal"
    DECODE_TRUSTS_BOOTSTRAP = "decode-trusts-bootstrap"
    NO_LEDGER_CHECK = "no-ledger-check"
    NO_INVALIDATE = "no-invalidate"
    EARLY_FREE = "early-free"
    ABORT_AS_SUCCESS = "abort-as-success"
    SHARED_PREFIX_CACHE = "shared-prefix-cache"
    POISONED_SAMPLING = "poisoned-sampling"

    @classmethod
    def parse(cls, name: str) -> Fault:
        try:
            return cls(name)
        except ValueError:
            known = ", ".join([*(f.value for f in cls), f"{HOLD}=FOLDER"])
            raise ValueError(f"unknown fault switch {name!r}; known switches: {known}") from None


# The requests `poisoned-sampling` fails: seeded with POISON_SEED + k (k < POISON_SPAN), the
# draw of output token k and every later one raises, so k = 0 fails in prefill's step and
# k >= 1 mid-stream, among other requests' decoding rows. "kvfault" in ASCII: a value no
# client picks by chance, and every path (HTTP edge, wire messages) carries it intact.
POISON_SEED = 0x6B766661756C74
POISON_SPAN = 1024


def poisoned_from(seed: int | None) -> int | None:
    """The output token index from which `poisoned-sampling` fails this seed; None: never."""
    if seed is None or not 0 <= seed - POISON_SEED < POISON_SPAN:
        return None
    return seed - POISON_SEED


@dataclass(frozen=True, slots=True)
class FaultInfo:
    recreates: str
    defence_removed: str


FAULT_INFO: dict[Fault, FaultInfo] = {
    Fault.UNDERSIZED_POOL: FaultInfo(
        "Workers AI 2026: prefill pool 681,280 tokens < advertised context 1,048,576",
        "I4 capacity gate at start-up and the router's edge limit",
    ),
    Fault.ABORT_NOT_TERMINAL: FaultInfo(
        "SGLang #30233: rejection stored aside, prompt replaced by a 1-token placeholder, "
        "finished() still False, admission tests `not finished()`",
        "I2 terminal REJECTED state and allow-list admission",
    ),
    Fault.DECODE_TRUSTS_BOOTSTRAP: FaultInfo(
        "SGLang #30233: decode attends every reserved page, whatever arrived; and SGLang's "
        "PD workers: a decode worker takes a client's bootstrap_host/port/room and prefill "
        "pairs by room alone, so a request naming another's room is served from its KV",
        "I3 manifest/reservation reconciliation; I9 bootstrap fields only on the router's "
        "path and a room bound to the tenant both workers authenticated",
    ),
    Fault.NO_LEDGER_CHECK: FaultInfo(
        "attention gathers pages without owner/generation/written-length verification",
        "I1 ledger verify on every attention gather",
    ),
    Fault.NO_INVALIDATE: FaultInfo(
        "release without generation bump (the article's ReleaseUnsafe): stale handles stay valid",
        "I5 invalidate on release",
    ),
    Fault.EARLY_FREE: FaultInfo(
        "SGLang #24527, vLLM #21570, GLM-5 postmortem: pages freed while a transfer can still land",
        "I7 deferred release",
    ),
    Fault.ABORT_AS_SUCCESS: FaultInfo(
        "SGLang #33507: an abort reported as finish_reason 'length' with HTTP 200",
        "I6 exactly one honest terminal outcome",
    ),
    Fault.SHARED_PREFIX_CACHE: FaultInfo(
        "CVE-2025-46570: prefix cache shared across tenants, observable by timing",
        "I8 per-tenant prefix-cache namespaces",
    ),
    Fault.POISONED_SAMPLING: FaultInfo(
        "one tenant's top_k (2**63) raised inside the sampler of a step shared with others, "
        "and every request in it failed with that tenant's error",
        "none: sampling raises for a request seeded with POISON_SEED + k from its output "
        "token k on, so that per-request isolation in a shared step can be seen holding",
    ),
}


# `hold=FOLDER`: the lab's holds, parameterised by the folder the test and workers share.
HOLD = "hold"
HOLD_INFO = FaultInfo(
    "none: parks a granted KV transfer before its first byte, and decode's step, while the "
    "test's flag files exist in FOLDER, so a test kills or freezes a worker at an exact point",
    "none: it only delays, every fence stays where it is",
)


@dataclass(frozen=True, slots=True)
class FaultSet:
    """An immutable set of active fault switches (empty = production)."""

    active: frozenset[Fault] = frozenset()
    hold: Path | None = None  # the lab's hold folder (`hold=FOLDER`); None: nothing is held

    @classmethod
    def of(cls, *faults: Fault | str) -> FaultSet:
        return cls(frozenset(f if isinstance(f, Fault) else Fault.parse(f) for f in faults))

    @classmethod
    def parse(cls, names: Iterable[str]) -> FaultSet:
        switches: list[str] = []
        hold: Path | None = None
        for name in names:
            key, eq, folder = name.partition("=")
            if key != HOLD:
                switches.append(name)
            elif hold is not None:
                raise ValueError(
                    f"{HOLD}=FOLDER is given twice ({hold} and {folder!r}); one folder"
                )
            else:
                hold = _hold_folder(folder if eq else "")
        return cls(cls.of(*switches).active, hold)

    def __contains__(self, fault: object) -> bool:
        return fault in self.active

    def __bool__(self) -> bool:
        return bool(self.active) or self.hold is not None

    def names(self) -> list[str]:
        """Every switch as `--lab-fault` takes it: `FaultSet.parse(s.names()) == s`."""
        held = [f"{HOLD}={self.hold}"] if self.hold is not None else []
        return sorted(f.value for f in self.active) + held


def _hold_folder(folder: str) -> Path:
    """An existing directory, absolute: every worker resolves it the same way, wherever it runs."""
    if not folder:
        raise ValueError(f"the lab's hold needs its folder: {HOLD}=FOLDER (an existing directory)")
    path = Path(folder).absolute()
    if not path.is_dir():
        raise ValueError(f"{HOLD}={folder}: no such directory (create the folder first)")
    return path
