"""Incident profiles: named sets of fault switches plus the scaled-down geometry they need.

The switches themselves live in one place (`kvfence.faults`); a profile
only chooses some of them. `workers-ai-2026` is the combination that leaked in
August 2026: an undersized prefill pool with the gate skipped, a reject path
that leaves the request alive on a 1-token placeholder, decode trusting the
bootstrap count, and no ownership check on attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.faults import Fault, FaultSet


@dataclass(frozen=True, slots=True)
class Scale:
    """The incident's numbers scaled down so a replay runs in seconds.

    Real: context 1,048,576 vs prefill pool 681,280 (ratio 0.65). Here: context
    `context_length` vs a prefill pool of `prefill_pages` x `page_size` tokens
    in the same proportion; the decode pool is large enough for every request.
    """

    context_length: int = 512
    page_size: int = 16
    prefill_pages: int = 21  # 336 tokens, 0.656 x context, like 681,280 / 1,048,576
    decode_pages: int = 64

    @property
    def prefill_pool_tokens(self) -> int:
        return self.prefill_pages * self.page_size


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    faults: FaultSet
    description: str
    model_kind: str = "mirror"
    scale: Scale = Scale()


INCIDENT_FAULTS = (
    Fault.UNDERSIZED_POOL,
    Fault.ABORT_NOT_TERMINAL,
    Fault.DECODE_TRUSTS_BOOTSTRAP,
    Fault.NO_LEDGER_CHECK,
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "workers-ai-2026",
            FaultSet.of(*INCIDENT_FAULTS),
            "Workers AI / GLM, Aug 2026: undersized prefill pool, rejected request left alive on a "
            "1-token placeholder, decode attends every reserved page, no ledger check",
        ),
        Profile("hardened", FaultSet(), "every defence on (production)"),
    )
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown lab profile {name!r}; known profiles: {', '.join(sorted(PROFILES))}"
        ) from None
