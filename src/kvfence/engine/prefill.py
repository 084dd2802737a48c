"""The prefill engine: admission, token-budget batching, chunked prefill, outbound transfers.

Network-free: it takes `PrefillWork`, `Abort` and transfer confirmations, and
leaves what it produces in `drain()`: failures for the router, aborts and
cancellations for decode, and outbound transfers for a KV transport.

Admission is an allow-list (I2): a request is admitted only while its state
is WAITING, and computed only while it is PREFILLING. A prompt that can never
fit this pool is REJECTED there, with the original error, before any
allocation or transfer; the router gets the error and decode an abort.
Under the lab switch `abort-not-terminal` the pre-fix SGLang path (#30233)
runs instead: the error goes to a side field, the prompt is replaced by a
1-token placeholder and the request stays alive, so one page is prefilled and
sent for a reservation that expects many.

The engine is this module; a prompt's own state and pages are `prefill_seq.py`,
the order waiting prompts are admitted in `prefill_order.py` (torch-free: the
command line offers its choices), and the KV a finished prompt hands a
transport `outbound.py` (what the transports depend on, not the engine).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from kvfence.engine.config import EngineConfig
from kvfence.engine.counters import Counters
from kvfence.engine.messages import Abort, Failure, PrefillWork, TransferDone
from kvfence.engine.outbound import OutboundTransfer
from kvfence.engine.prefill_order import admission_order, note_admitted
from kvfence.engine.prefill_seq import PrefillSeq
from kvfence.engine.prefix_cache import PrefixCache
from kvfence.engine.request import Request, RequestError, RequestState
from kvfence.engine.row_errors import RowError
from kvfence.engine.runner import Forwarded, ModelRunner, release_current
from kvfence.engine.sampling import Sampler, SampleRow, TokenLogprobs
from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import KVPool, PageHandle
from kvfence.model.base import CausalLM
from kvfence.model.batching import RowSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillOutput:
    """What prefill produced since the last `drain()`, by destination."""

    to_router: list[Failure] = field(default_factory=list)
    to_decode: list[Abort | TransferDone] = field(default_factory=list)
    transfers: list[OutboundTransfer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.to_router or self.to_decode or self.transfers)


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """One planned prefill step: (prompt, tokens this step) pairs and the rows they run as."""

    plan: list[tuple[PrefillSeq, int]]
    rows: list[RowSpec]


class PrefillEngine:
    """Usage: `submit(work)`, `abort(room)`, `step()` while `has_work`, then `drain()`."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        config: EngineConfig,
        faults: FaultSet | None = None,
    ) -> None:
        if pool.page_size != config.page_size:
            raise ValueError(f"pool page size {pool.page_size} != config {config.page_size}")
        self.pool = pool
        self.config = config
        self.faults = faults or FaultSet()
        self.runner = ModelRunner(model, pool)
        self.sampler = Sampler(config.sampler_seed, self.faults)
        self.cache = PrefixCache(
            pool,
            faults=self.faults,
            shared_namespace=config.shared_prefix_namespace,
            enabled=config.prefix_cache,
        )
        self.waiting: deque[PrefillSeq] = deque()
        self.running: list[PrefillSeq] = []  # PREFILLING, holding pages
        # Handed to the transport: their pages are held until it confirms (I7).
        self.sending: dict[str, PrefillSeq] = {}
        self.seqs: dict[str, PrefillSeq] = {}
        self.counters = Counters()
        self._out = PrefillOutput()
        self._arrivals = itertools.count()

    # ---- inputs -------------------------------------------------------------------------

    def submit(self, work: PrefillWork) -> None:
        if work.room in self.seqs:
            # I9: rooms are unique; a second work for a live room is refused, never merged.
            log.warning("refusing prefill work for room %s: already in progress", work.room)
            return
        req = Request(work.room, work.tenant, work.prompt_ids, work.sampling.max_tokens)
        namespace = self.cache.resolve(work.cache_namespace)
        seq = PrefillSeq(
            req=req,
            work=work,
            owner=self.pool.register_owner(f"prefill:{work.tenant}:{work.room}"),
            namespace=namespace,
            ns_owner=self.cache.owner_for(namespace),
            input_ids=work.prompt_ids,
            arrival=next(self._arrivals),
        )
        self.seqs[work.room] = seq
        self.waiting.append(seq)

    def abort(self, room: str, reason: str) -> None:
        """Stop a request wherever it is. Pages in flight wait for `transfer_done` (I7)."""
        seq = self.seqs.get(room)
        if seq is None or seq.req.terminal:
            return
        seq.req.abort(RequestError(499, "aborted", reason))
        self.counters.aborted += 1
        if room in self.sending:
            return  # the transport still owns the outcome; transfer_done releases
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        # Nothing will ever be sent for this room: decode may free its reservation (I7).
        self._out.to_decode.append(TransferDone(room, ok=False))

    def transfer_done(self, room: str, ok: bool) -> None:
        """The transport finished (or gave up on) sending this request's KV: pages may go."""
        seq = self.sending.pop(room, None)
        if seq is None:
            return
        if seq.req.state is RequestState.TRANSFERRING:
            if ok:
                seq.req.advance(RequestState.FINISHED)  # prefill's part is done
                self.counters.transferred += 1
            else:
                seq.req.fail(RequestError(502, "transfer_error", "the KV transfer failed"))
                self.counters.failed += 1
        self._release(seq)

    # ---- the step -----------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether `step` can make progress now (so a loop can sleep instead of spinning)."""
        if self.running:
            return True
        if not self.waiting:
            return False
        cap = self.pool.capacity_tokens
        if any(not self._admissible(s) or len(s.input_ids) > cap for s in self.waiting):
            return True  # the step drops or rejects it
        head = self._admission_order()[0]
        need = self.pool.geometry.pages_for(len(head.input_ids))
        return need <= self.pool.num_free + self.cache.num_evictable

    def drain(self) -> PrefillOutput:
        out, self._out = self._out, PrefillOutput()
        return out

    def step(self) -> None:
        """schedule chunks -> forward (I1: verified before any read) -> sample -> send."""
        planned = self.plan_step()
        if planned is not None:
            self.finish_step(planned, self.runner.forward_checked(planned.rows))

    def plan_step(self, budget: int | None = None) -> PrefillStep | None:
        """Running prompts' next chunks, then new prompts, within `budget` new tokens
        (default `max_batch_tokens`); None when nothing can run."""
        budget = self.config.max_batch_tokens if budget is None else budget
        # Fairness: a prompt from a tenant with nothing in prefill goes first, alone, for one
        # step, so a short prompt never waits behind another tenant's long chunks; each such
        # arrival delays the running chunks by one step at most (no starvation). When it cannot
        # get its pages, which the running prompts may hold, they run after all (no livelock).
        busy = {seq.req.tenant for seq in self.running}
        newcomer = any(seq.req.tenant not in busy for seq in self.waiting)
        plan = [] if newcomer else self._schedule_running(budget)
        plan += self._admit(budget - sum(n for _, n in plan))
        if newcomer and not plan:
            plan = self._schedule_running(budget)
        if not plan:
            return None
        now = time.perf_counter()  # a prompt's prefill time runs from its first step (signal 3)
        for seq, _ in plan:
            seq.started_s = now if seq.started_s is None else seq.started_s
        return PrefillStep(plan, self._rows(plan))

    def finish_step(self, planned: PrefillStep, out: Forwarded) -> None:
        """Take the step's forward: fail refused rows (I1) and rows that raised alone, record
        chunks, send finished prompts (a prompt whose sampling raises alone fails alone)."""
        plan = self._drop_refused(planned.plan, out)
        done = self._advance(plan)
        if done and out.logits is not None:
            rows = [SampleRow(plan[i][0].work.sampling, 0) for i in done]
            drawn = self.sampler.sample_isolated(out.logits[done], rows)
            for i, sampled in zip(done, drawn, strict=True):
                if isinstance(sampled, RowError):
                    self._fail(plan[i][0], sampled.request_error())
                else:
                    self._send(plan[i][0], sampled[0], sampled[1] or ())

    def _schedule_running(self, budget: int) -> list[tuple[PrefillSeq, int]]:
        """The next chunk of every running prompt, oldest first, while the budget lasts."""
        plan: list[tuple[PrefillSeq, int]] = []
        for seq in self.running:
            if budget == 0:
                break
            n = min(seq.remaining, self.config.step_chunk, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def _admit(self, budget: int) -> list[tuple[PrefillSeq, int]]:
        """Waiting prompts, in admission order, that get all their pages now; the first that
        cannot waits, and so does everything after it (no prompt passes one waiting for pages)."""
        for seq in list(self.waiting):
            if not self._admissible(seq) or not self._check_capacity(seq):
                self.waiting.remove(seq)  # aborted while queued, or rejected: nothing allocated
        plan: list[tuple[PrefillSeq, int]] = []
        for seq in self._admission_order():
            if budget == 0:
                break
            if not seq.take_pages(self.pool, self.cache):
                break  # clean queuing: wait for pages, never a partial allocation
            self.waiting.remove(seq)
            note_admitted(self.waiting, seq)
            seq.req.advance(RequestState.PREFILLING)
            self.running.append(seq)
            n = min(seq.remaining, self.config.step_chunk, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def _admission_order(self) -> list[PrefillSeq]:
        return admission_order(self.waiting, self.config.prefill_order, self.config.max_overtakes)

    def _admissible(self, seq: PrefillSeq) -> bool:
        if Fault.ABORT_NOT_TERMINAL in self.faults:
            return not seq.req.legacy_finished()  # SGLang #30233: blind to to_finish
        return seq.req.state is RequestState.WAITING  # I2: allow-list, never `not finished()`

    def _check_capacity(self, seq: PrefillSeq) -> bool:
        """A prompt that can never fit this pool ends here, before allocation or transfer (I2)."""
        n, cap = len(seq.input_ids), self.pool.capacity_tokens
        if n <= cap:
            return True
        error = RequestError(
            400,
            "invalid_request_error",
            f"prompt has {n} tokens; this prefill pool holds at most {cap} tokens "
            f"({self.pool.num_pages} pages of {self.pool.page_size})",
            param="prompt",
            code="context_length_exceeded",
        )
        if Fault.ABORT_NOT_TERMINAL in self.faults:
            # The pre-fix reject path: error stored aside, 1-token placeholder, still "alive".
            seq.req.to_finish = error
            seq.input_ids = seq.input_ids[:1]
            return True
        seq.req.reject(error)
        self.counters.rejected += 1
        self._out.to_router.append(Failure(seq.req.rid, error.info()))
        self._out.to_decode.append(Abort(seq.req.rid, f"rejected by prefill: {error.message}"))
        self._out.to_decode.append(TransferDone(seq.req.rid, ok=False))
        self._release(seq)
        return False

    def _rows(self, plan: list[tuple[PrefillSeq, int]]) -> list[RowSpec]:
        ps = self.pool.page_size
        rows = []
        for seq, n in plan:
            end = seq.computed + n
            rows.append(
                RowSpec(
                    token_ids=seq.input_ids[seq.computed : end],
                    start=seq.computed,
                    pages=seq.pages[: -(-end // ps)],
                    reader=seq.owner,
                    namespace=seq.ns_owner,
                    num_generated=0,
                )
            )
        return rows

    def _drop_refused(
        self, plan: list[tuple[PrefillSeq, int]], out: Forwarded
    ) -> list[tuple[PrefillSeq, int]]:
        """Fail the rows whose page tables the ledger refused (I1), and the rows that raised
        when run alone (each with its own error); the rest ran."""
        for i in out.refused:
            self.counters.isolation_violations += 1
            self._fail(plan[i][0], RequestError(500, "isolation_violation", str(out.violation)))
        for failed in out.failed:
            self._fail(plan[failed.index][0], failed.request_error())
        return [plan[i] for i in out.kept]

    def _advance(self, plan: list[tuple[PrefillSeq, int]]) -> list[int]:
        """Record what the step computed; the indices (into `plan`) of prompts now complete."""
        done = []
        for i, (seq, n) in enumerate(plan):
            start = seq.computed
            seq.computed += n
            self.counters.computed_tokens += n
            seq.offer_full_pages(self.cache, self.pool.page_size, start)
            if seq.remaining == 0:
                done.append(i)
        return done

    def _send(self, seq: PrefillSeq, token: int, logprobs: TokenLogprobs) -> None:
        self.running.remove(seq)
        seq.req.advance(RequestState.TRANSFERRING)
        self.sending[seq.req.rid] = seq
        self._out.transfers.append(
            OutboundTransfer(
                room=seq.req.rid,
                tenant=seq.req.tenant,
                num_tokens=len(seq.input_ids),
                dest_pages=seq.work.dest_pages,
                src_pages=tuple(seq.pages),
                first_token=token,
                first_logprobs=logprobs,
                cached_tokens=seq.cached_tokens,
                prefill_s=time.perf_counter() - (seq.started_s or time.perf_counter()),
            )
        )

    def _fail(self, seq: PrefillSeq, error: RequestError) -> None:
        """A running prompt ends with `error`: its pages go now, decode is told (I6, I7)."""
        self.counters.failed += 1
        seq.req.fail(error)
        self.running.remove(seq)
        self._release(seq)
        self._out.to_router.append(Failure(seq.req.rid, error.info()))
        self._out.to_decode.append(Abort(seq.req.rid, "prefill failed"))
        self._out.to_decode.append(TransferDone(seq.req.rid, ok=False))

    def _release(self, seq: PrefillSeq) -> None:
        release_current(self.pool, seq.own_pages)
        self.cache.release(seq.cache_keys)
        seq.own_pages, seq.cache_keys, seq.pages = [], [], []
        self.pool.forget_owner(seq.owner)
        self.seqs.pop(seq.req.rid, None)

    # ---- introspection ------------------------------------------------------------------

    def outstanding_handles(self) -> list[PageHandle]:
        """Every handle prefill holds (for `pool.check_integrity`)."""
        held = [h for s in self.seqs.values() for h in s.own_pages]
        return held + self.cache.handles()
