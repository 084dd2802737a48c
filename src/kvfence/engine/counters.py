"""One counters type for every place that counts requests: the engines, a worker's status, a
backend's stats. Isolation violations and transfer mismatches must stay 0 in production."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class Counters:
    """Counts since start. An engine fills the fields of its role; the rest stay 0."""

    finished: int = 0
    rejected: int = 0
    aborted: int = 0
    failed: int = 0
    prompt_tokens: int = 0  # the router role's count (each request once)
    generation_tokens: int = 0
    computed_tokens: int = 0  # prefill: prompt tokens run through the model
    transferred: int = 0  # prefill: KV transfers confirmed
    preempted: int = 0  # decode: rows failed because the pool could not grow any row
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    isolation_violations: int = 0
    transfer_mismatches: int = 0
    transfer_failures: int = 0

    def __add__(self, other: Counters) -> Counters:
        return Counters(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def snapshot(self) -> Counters:
        return dataclasses.replace(self)

    @staticmethod
    def total(parts: Iterable[Counters]) -> Counters:
        out = Counters()
        for part in parts:
            out = out + part
        return out
