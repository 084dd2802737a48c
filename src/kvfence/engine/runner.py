"""Runs the model on one step's rows (`RowSpec`s, built into a `ForwardBatch` by the model's builder).

The runner is the only engine code that touches the model. The model records
the slots it writes and verifies every page table against the ledger before
any gather (I1); when that check fails, `forward_checked` finds the rows whose
own tables the ledger refuses and re-runs the step once for the rest, so an
engine fails just those rows (the one place that retry lives).

Any other exception in a step is isolated the same way: each row runs again
alone, and a row that still raises fails with its own error (`RowError`) while
the rest keep their logits, so one request that makes the model raise never
fails the step's other requests. Running a row again is safe: its K/V writes
go to the same slots of its own pages (`index_copy_`) and the written-slot
marks only ever grow (`scatter_reduce_` with amax), so a second write of the
same positions changes nothing the ledger or another row can see. When every
row raises alone and so does a one-token probe of no request (`probe`), no
request explains the failure: that is `StepFailed`, an engine fault the
caller must not pin on a request.

`forward_together` runs several runners' rows (the in-process prefill's and
decode's, each on its own pool) as one model step, so the weights are read
once for both; every pool's tables are verified before any of them is read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.engine.row_errors import RowError, StepFailed, describe
from kvfence.kv.pool import BatchPages, IsolationViolation, KVPool, PageHandle, PageState
from kvfence.model.base import CausalLM
from kvfence.model.batching import RowSpec, build_forward_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Forwarded:
    """One step's outcome: logits for the rows that ran, and the rows the ledger refused (I1)."""

    logits: torch.Tensor | None  # [len(kept), vocab]; None when no row ran
    kept: list[int]  # indices into the step's rows, in order
    refused: list[int]
    violation: IsolationViolation | None = None
    failed: tuple[RowError, ...] = ()  # rows that raised alone (never in `kept` or `refused`)


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.page_size = pool.page_size

    def forward(self, rows: Sequence[RowSpec]) -> torch.Tensor:
        """Logits [B, vocab] for each row's last new token."""
        batch = build_forward_batch(self.page_size, rows)
        with torch.inference_mode():
            return self.model(batch, self.pool)

    def forward_checked(self, rows: Sequence[RowSpec]) -> Forwarded:
        """`forward`, except that rows whose own page tables fail the ledger check are dropped
        and the step re-run once for the rest, and rows that make the step raise are isolated
        (`rerun_alone`). A violation no single row explains is raised, and so is `StepFailed`."""
        try:
            return self._forward_isolating(rows)
        except IsolationViolation as violation:
            refused = self.offending_rows(rows)
            if not refused:
                raise
            kept = [i for i in range(len(rows)) if i not in set(refused)]
            if not kept:
                return Forwarded(None, [], refused, violation)
            rest = self._forward_isolating([rows[i] for i in kept])
            failed = tuple(RowError(kept[f.index], f.message) for f in rest.failed)
            return Forwarded(rest.logits, [kept[i] for i in rest.kept], refused, violation, failed)

    def _forward_isolating(self, rows: Sequence[RowSpec]) -> Forwarded:
        try:
            return Forwarded(self.forward(rows), list(range(len(rows))), [])
        except IsolationViolation:
            raise  # the ledger's refusal: `forward_checked` finds the rows it names
        except Exception as error:
            return self.rerun_alone(rows, error)

    def rerun_alone(self, rows: Sequence[RowSpec], error: Exception) -> Forwarded:
        """The step raised `error`: run each row alone; the rows that raise again fail alone.

        Raises `StepFailed` when every row raises and the probe does too: the fault is
        the engine's, and failing the requests as if it were theirs would be a false verdict.
        """
        log.warning("a %d-row step raised %s: running each row alone", len(rows), error)
        parts: list[torch.Tensor] = []
        kept: list[int] = []
        failed: list[RowError] = []
        for i, row in enumerate(rows):
            try:
                parts.append(self.forward([row]))
                kept.append(i)
            except IsolationViolation:
                raise
            except Exception as e:
                failed.append(RowError(i, describe(e)))
        if not kept:
            broken = self.probe()
            if broken is not None:
                raise StepFailed(
                    f"every row of a {len(rows)}-row step raised alone ({describe(error)}), "
                    f"and so did a one-token probe ({broken})"
                ) from error
        return Forwarded(torch.cat(parts) if parts else None, kept, [], None, tuple(failed))

    def probe(self) -> str | None:
        """Whether the model runs at all: a one-token step of no request, in a scratch page.

        None when it runs, or when no page is free to try it (the rows' own failures then
        stand); else its error. It tells an engine fault from requests that all raise on
        their own (several bad requests in one step must not take the engine down).
        """
        if not self.pool.can_allocate(1):
            return None
        owner = self.pool.register_owner("probe")
        handles = self.pool.allocate(owner, 1)
        try:
            self.forward([RowSpec(pages=handles, reader=owner, token_ids=(0,), start=0)])
            return None
        except Exception as e:
            return describe(e)
        finally:
            release_current(self.pool, handles)
            self.pool.forget_owner(owner)

    def offending_rows(self, rows: Sequence[RowSpec]) -> list[int]:
        """After an `IsolationViolation`: the rows whose own page tables the ledger refuses."""
        bad = []
        for i, row in enumerate(rows):
            try:
                self.pool.verify(
                    BatchPages.build([row.pages], [row.reader], [row.namespace], [row.length])
                )
            except IsolationViolation:
                bad.append(i)
        return bad


def forward_together(steps: Sequence[tuple[ModelRunner, Sequence[RowSpec]]]) -> list[Forwarded]:
    """One model step for several runners' rows, each runner's rows on its own pool.

    When the ledger refuses anything (I1) the model has written and read
    nothing yet; each runner then runs alone through `forward_checked`, which
    fails exactly the refused rows. Any other exception takes the same path,
    where each runner isolates the rows that raise.
    """
    model = steps[0][0].model
    if any(runner.model is not model for runner, _ in steps):
        raise ValueError("forward_together needs runners of one model")
    parts = [(build_forward_batch(r.page_size, rows), r.pool) for r, rows in steps]
    try:
        with torch.inference_mode():
            logits = model.forward_many(parts)
    except Exception:
        # A refusal (I1) or a row that made the step raise: each runner on its own finds
        # and fails exactly its rows at fault (rows run again write the same slots).
        return [runner.forward_checked(rows) for runner, rows in steps]
    return [
        Forwarded(out, list(range(len(rows))), [])
        for out, (_, rows) in zip(logits, steps, strict=True)
    ]


def release_current(pool: KVPool, handles: Sequence[PageHandle]) -> list[PageHandle]:
    """Release the handles the ledger still grants to their holder; return the stale rest.

    After an isolation violation some handles may no longer be the holder's
    (e.g. a page reused under it): those are not ours to release (I5).
    """
    if not handles:
        return []
    idx = torch.tensor([h.index for h in handles], dtype=torch.int64)
    gens = torch.tensor([h.generation for h in handles], dtype=torch.int64)
    owners = torch.tensor([h.owner for h in handles], dtype=torch.int64)
    ok = (
        (pool.state[idx] == PageState.USED)
        & (pool.generation[idx] == gens)
        & (pool.owner[idx] == owners)
    ).tolist()
    pool.release([h for h, good in zip(handles, ok, strict=True) if good])
    return [h for h, good in zip(handles, ok, strict=True) if not good]
