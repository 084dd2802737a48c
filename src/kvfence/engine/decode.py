"""The decode engine: reservations, transfer reconciliation, continuous-batching decode.

Network-free: it takes `Bootstrap`, transfer manifests, inbound-closed
confirmations and `Abort`, and leaves what it produces in `drain()`:
`BootstrapReady` for the router, `TokenChunk`s and `Failure`s for the client.

The reservation protocol (docs/ARCHITECTURE.md, "Data flow and the reservation protocol"):
  bootstrap  reserve pages for EXACTLY the prompt (owned by this request,
             generation-stamped) and mark them inbound: a transfer may land
             from the moment their handles leave this engine (I7);
  transfer   the transport writes the pages, closes the inbound window, then
             hands over the manifest; decode reconciles it against the
             reservation (I3) before anything is decoded;
  decode     every DECODING row, every step, attending only its own pages.
A reservation released while its inbound window is open parks its pages
until the transport confirms (I7).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kvfence.engine.config import EngineConfig
from kvfence.engine.counters import Counters
from kvfence.engine.inbound import InboundWindow, PoolInbound
from kvfence.engine.messages import (
    Bootstrap,
    BootstrapReady,
    Failure,
    PageRef,
    TokenChunk,
    TransferManifest,
)
from kvfence.engine.reconcile import (
    Reservation,
    TransferMismatch,
    reconcile,
)
from kvfence.engine.reconcile import (
    payload_checksum as measure_checksum,
)
from kvfence.engine.request import Request, RequestError, RequestState
from kvfence.engine.row_errors import RowError
from kvfence.engine.runner import Forwarded, ModelRunner, release_current
from kvfence.engine.sampling import Sampler, SampleRow, TokenLogprobs, stop_reason
from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import FREE_OWNER, KVPool, PageHandle
from kvfence.model.base import CausalLM
from kvfence.model.batching import RowSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeOutput:
    """What decode produced since the last `drain()`: all of it goes to the router."""

    ready: list[BootstrapReady] = field(default_factory=list)
    events: list[TokenChunk | Failure] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ready or self.events)


@dataclass(slots=True, eq=False)
class _Seq:
    req: Request
    boot: Bootstrap
    owner: int
    pages: list[PageHandle] = field(default_factory=list)
    reservation: Reservation | None = None
    context: int = 0  # positions holding KV that this row attends
    last_token: int = 0  # the token fed to the next step
    num_generated: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0  # reported once, on the first chunk


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One planned decode step: the rows' sequences and the `RowSpec`s they run as."""

    seqs: list[_Seq]
    rows: list[RowSpec]


class DecodeEngine:
    """Usage: `bootstrap(b)`, transport writes, `inbound_closed(room)`, `on_transfer(m, checksum)`,
    then `step()` while `has_work`; `drain()` for what to send on."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        config: EngineConfig,
        faults: FaultSet | None = None,
        *,
        inbound: InboundWindow | None = None,
    ) -> None:
        if pool.page_size != config.page_size:
            raise ValueError(f"pool page size {pool.page_size} != config {config.page_size}")
        self.pool = pool
        self.config = config
        self.faults = faults or FaultSet()
        self.runner = ModelRunner(model, pool)
        self.sampler = Sampler(config.sampler_seed, self.faults)
        self.eos = frozenset(config.eos_token_ids)
        self.local_inbound = PoolInbound(pool)
        self.window: InboundWindow = inbound or self.local_inbound
        self.queued: deque[_Seq] = deque()  # bootstraps waiting for pages
        self.seqs: dict[str, _Seq] = {}
        self.running: list[_Seq] = []  # DECODING, in admission order
        self.counters = Counters()
        self._out = DecodeOutput()

    # ---- bootstrap ----------------------------------------------------------------------

    def bootstrap(self, boot: Bootstrap) -> BootstrapReady | Failure | None:
        """Reserve pages for exactly the prompt; None = queued until pages free up."""
        if boot.room in self.seqs or boot.room in self.local_inbound.open:
            error = RequestError(409, "conflict", f"room {boot.room} is already in use (I9)")
            self.counters.rejected += 1
            return Failure(boot.room, error.info())
        if boot.num_prompt_tokens < 1 or boot.max_tokens < 1:
            error = RequestError(
                400,
                "invalid_request_error",
                f"a request needs >= 1 prompt token and max_tokens >= 1, got "
                f"{boot.num_prompt_tokens} and {boot.max_tokens}",
            )
            self.counters.rejected += 1
            return Failure(boot.room, error.info())
        cap = self.pool.capacity_tokens
        if boot.num_prompt_tokens > cap:
            error = RequestError(
                400,
                "invalid_request_error",
                f"prompt has {boot.num_prompt_tokens} tokens; this decode pool holds at most "
                f"{cap} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
            self.counters.rejected += 1
            return Failure(boot.room, error.info())
        req = Request(boot.room, boot.tenant, (0,) * boot.num_prompt_tokens, boot.max_tokens)
        seq = _Seq(req, boot, self.pool.register_owner(f"decode:{boot.tenant}:{boot.room}"))
        self.seqs[boot.room] = seq
        if not self.queued and self._reserve(seq):
            return self._ready(seq)
        self.queued.append(seq)
        return None

    def _reserve(self, seq: _Seq) -> bool:
        n = self.pool.geometry.pages_for(seq.boot.num_prompt_tokens)
        if not self.pool.can_allocate(n):
            return False  # never a partial reservation
        handles = self.pool.allocate(seq.owner, n)
        seq.pages = list(handles)
        seq.reservation = Reservation(
            seq.req.rid, seq.req.tenant, seq.boot.num_prompt_tokens, tuple(handles)
        )
        self.window.expect(seq.reservation)  # I7: a transfer may land from now on
        seq.req.advance(RequestState.BOOTSTRAPPING)
        return True

    @staticmethod
    def _ready(seq: _Seq) -> BootstrapReady:
        return BootstrapReady(seq.req.rid, tuple(PageRef(h.index, h.generation) for h in seq.pages))

    # ---- transfer -----------------------------------------------------------------------

    def inbound_closed(self, room: str) -> None:
        """The transport confirmed nothing more will land for `room` (written, cancelled, or sender dead)."""
        self.local_inbound.close(room)

    def on_transfer(self, manifest: TransferManifest, payload_checksum: str | None) -> None:
        """Accept a landed transfer only against its reservation (I3); then the row decodes.

        `payload_checksum` is what the transport measured as the bytes landed,
        or None when the sender wrote in place: then decode checksums its own pages.
        """
        seq = self.seqs.get(manifest.room)
        if (
            seq is None
            or seq.req.state is not RequestState.BOOTSTRAPPING
            or seq.reservation is None
        ):
            return  # aborted meanwhile (its pages wait for inbound_closed) or never reserved
        seq.req.advance(RequestState.TRANSFERRING)
        if payload_checksum is None:
            payload_checksum = measure_checksum(
                self.pool, seq.reservation.handles, seq.reservation.num_tokens
            )
        try:
            # I3. Under `decode-trusts-bootstrap` reconcile skips its checks (the pool's
            # fault set) but still marks written only what the manifest says landed.
            reconcile(manifest, seq.reservation, self.pool, payload_checksum)
        except TransferMismatch as mismatch:
            self._refuse_transfer(seq, mismatch)
            return
        if Fault.DECODE_TRUSTS_BOOTSTRAP in self.faults:
            # SGLang #30233: attend every reserved position, whatever arrived.
            seq.context = seq.reservation.num_tokens
        else:
            seq.context = manifest.num_tokens
        seq.req.advance(RequestState.DECODING)
        seq.cached_tokens = manifest.cached_tokens
        seq.prefill_s = manifest.prefill_s
        self.running.append(seq)
        self._emit(seq, manifest.first_token, manifest.first_logprobs)

    def _refuse_transfer(self, seq: _Seq, mismatch: TransferMismatch) -> None:
        """I3 refused what landed: the request fails with a 502 and its pages are invalidated (I5)."""
        self.counters.transfer_mismatches += 1
        error = RequestError(
            502, "transfer_mismatch", f"KV transfer refused: {mismatch}", code="transfer_mismatch"
        )
        self._end_failed(seq, error)

    # ---- abort --------------------------------------------------------------------------

    def abort(self, room: str, reason: str) -> None:
        """Stop `room` at any stage; a reservation still open to a transfer is parked (I7)."""
        seq = self.seqs.get(room)
        if seq is None or seq.req.terminal:
            return
        was = seq.req.state
        seq.req.abort(RequestError(499, "aborted", reason))
        self.counters.aborted += 1
        if seq in self.queued:
            self.queued.remove(seq)
        elif was is RequestState.BOOTSTRAPPING:
            self.window.cancel(room)  # the pages stay parked until the transport confirms (I7)
        self._close(seq)

    # ---- the step -----------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        if self.running:
            return True
        if not self.queued:
            return False
        head = self.pool.geometry.pages_for(self.queued[0].boot.num_prompt_tokens)
        return self.pool.can_allocate(head)

    def drain(self) -> DecodeOutput:
        out, self._out = self._out, DecodeOutput()
        return out

    def step(self) -> None:
        """admit -> schedule -> forward (I1: verified before any read) -> sample -> emit."""
        planned = self.plan_step()
        if planned is not None:
            self.finish_step(planned, self.runner.forward_checked(planned.rows))

    def plan_step(self) -> DecodeStep | None:
        """Admit queued reservations, then this step's rows (one token each); None when none."""
        self._admit_queued()
        seqs = self._schedule()
        return DecodeStep(seqs, [self._row(s) for s in seqs]) if seqs else None

    def finish_step(self, planned: DecodeStep, out: Forwarded) -> None:
        """Take the step's forward: fail refused rows (I1) and rows that raised alone, sample
        and emit the rest (a row whose sampling raises alone fails alone)."""
        seqs = self._drop_refused(planned.seqs, out)
        if out.logits is None:
            return
        drawn = self.sampler.sample_isolated(
            out.logits, [SampleRow(s.boot.sampling, s.num_generated) for s in seqs]
        )
        for seq, sampled in zip(seqs, drawn, strict=True):
            if isinstance(sampled, RowError):
                self._end_failed(seq, sampled.request_error())
                continue
            seq.context += 1
            self._emit(seq, sampled[0], sampled[1] or ())

    def _admit_queued(self) -> None:
        while self.queued and self._reserve(self.queued[0]):
            self._out.ready.append(self._ready(self.queued.popleft()))

    def _schedule(self) -> list[_Seq]:
        """Every DECODING row that has (or can get) a page for its next token; others hold."""
        ps = self.pool.page_size
        seqs: list[_Seq] = []
        held: list[_Seq] = []
        for seq in self.running[: self.config.max_running]:
            if seq.req.state is not RequestState.DECODING:  # I2: allow-list
                continue
            if seq.context >= len(seq.pages) * ps:
                if not self.pool.can_allocate(1):
                    held.append(seq)
                    continue
                seq.pages.extend(self.pool.allocate(seq.owner, 1))
            seqs.append(seq)
        if not seqs and held:
            # No row can grow: end the newest one honestly rather than stall everyone.
            victim = held[-1]
            self.counters.preempted += 1
            self._end_failed(
                victim,
                RequestError(503, "server_overloaded", "the decode KV pool ran out of pages"),
            )
        return seqs

    def _row(self, seq: _Seq) -> RowSpec:
        """The row's last token at its next position, reading only its own pages."""
        return RowSpec(
            token_ids=(seq.last_token,),
            start=seq.context,
            pages=seq.pages[: seq.context // self.pool.page_size + 1],
            reader=seq.owner,
            namespace=FREE_OWNER,
            num_generated=seq.num_generated,
        )

    def _drop_refused(self, seqs: list[_Seq], out: Forwarded) -> list[_Seq]:
        """Fail the rows whose page tables the ledger refused (I1), and the rows that raised
        when run alone (each with its own error); the rest ran."""
        for i in out.refused:
            self.counters.isolation_violations += 1
            self._end_failed(seqs[i], RequestError(500, "isolation_violation", str(out.violation)))
        for failed in out.failed:
            self._end_failed(seqs[failed.index], failed.request_error())
        return [seqs[i] for i in out.kept]

    # ---- outcomes -----------------------------------------------------------------------

    def _emit(self, seq: _Seq, token: int, logprobs: TokenLogprobs) -> None:
        seq.num_generated += 1
        seq.last_token = token
        self.counters.generation_tokens += 1
        reason = stop_reason(token, seq.num_generated, seq.boot.sampling, self.eos)
        if reason is None and seq.context + 1 >= self.config.context_length:
            reason = "length"  # prompt + output reached the context window
        self._out.events.append(
            TokenChunk(
                seq.req.rid,
                (token,),
                (logprobs,) if logprobs else (),
                finish_reason=reason,
                cached_tokens=seq.cached_tokens,
                prefill_s=seq.prefill_s if seq.num_generated == 1 else 0.0,
            )
        )
        if reason is not None:
            seq.req.finish(reason)
            self.counters.finished += 1
            self._close(seq)

    def _end_failed(self, seq: _Seq, error: RequestError) -> None:
        seq.req.fail(error)
        self.counters.failed += 1
        self._out.events.append(Failure(seq.req.rid, error.info()))
        self._close(seq)

    def _close(self, seq: _Seq) -> None:
        """Invalidate the request's pages (I5); parked while a transfer may land (I7)."""
        if seq in self.running:
            self.running.remove(seq)
        stale = release_current(self.pool, seq.pages)
        if stale:
            log.error("room %s held %d stale page handle(s); not released", seq.req.rid, len(stale))
        seq.pages = []
        self.pool.forget_owner(seq.owner)
        del self.seqs[seq.req.rid]

    # ---- queries for workers ------------------------------------------------------------

    def rooms(self) -> list[str]:
        """Every room this engine still holds (queued, awaiting its transfer, or decoding)."""
        return list(self.seqs)

    def awaiting_transfer(self, room: str) -> bool:
        """Whether `room` holds a reservation its KV transfer has not landed in yet."""
        seq = self.seqs.get(room)
        return seq is not None and seq.req.state is RequestState.BOOTSTRAPPING

    def outstanding_handles(self) -> list[PageHandle]:
        return [h for s in self.seqs.values() for h in s.pages]
