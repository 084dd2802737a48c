"""One prompt in prefill, and what prefill hands on: the engine's own state, no logic."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.engine.messages import Abort, Failure, PrefillWork, TransferDone
from kvfence.engine.outbound import OutboundTransfer
from kvfence.engine.request import Request
from kvfence.kv.pool import PageHandle
from kvfence.model.batching import RowSpec


@dataclass(slots=True)
class PrefillOutput:
    """What prefill produced since the last `drain()`, by destination."""

    to_router: list[Failure] = field(default_factory=list)
    to_decode: list[Abort | TransferDone] = field(default_factory=list)
    transfers: list[OutboundTransfer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.to_router or self.to_decode or self.transfers)


@dataclass(slots=True, eq=False)
class PrefillSeq:
    req: Request
    work: PrefillWork
    owner: int  # this request's own pool owner id
    namespace: str  # resolved prefix-cache namespace (I8)
    ns_owner: int  # pool owner id of that namespace
    input_ids: tuple[int, ...]  # what is computed: the prompt (or the lab's placeholder)
    arrival: int = 0  # submission order, for admission (`prefill_order`)
    overtaken: int = 0  # later arrivals admitted while this one waited
    pages: list[PageHandle] = field(default_factory=list)  # covers input_ids, in order
    own_pages: list[PageHandle] = field(default_factory=list)  # released by this request
    cache_keys: list[int] = field(default_factory=list)  # cache references held
    parent_key: int | None = None  # chain key of the last full page computed
    computed: int = 0
    cached_tokens: int = 0
    started_s: float | None = None  # perf_counter at its first forward step (prefill time)

    @property
    def remaining(self) -> int:
        return len(self.input_ids) - self.computed


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """One planned prefill step: (prompt, tokens this step) pairs and the rows they run as."""

    plan: list[tuple[PrefillSeq, int]]
    rows: list[RowSpec]
