"""Runs the model on one step's rows (`RowSpec`s, built into a `ForwardBatch` by the model's builder).

The runner is the only engine code that touches the model. The model records
the slots it writes and verifies every page table against the ledger before
any gather (I1); when that check fails, `forward_checked` finds the rows whose
own tables the ledger refuses and re-runs the step once for the rest, so an
engine fails just those rows (the one place that retry lives).

`forward_together` runs several runners' rows (the in-process prefill's and
decode's, each on its own pool) as one model step, so the weights are read
once for both; every pool's tables are verified before any of them is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.kv.pool import BatchPages, IsolationViolation, KVPool, PageHandle, PageState
from kvfence.model.base import CausalLM
from kvfence.model.batching import RowSpec, build_forward_batch


@dataclass(frozen=True, slots=True)
class Forwarded:
    """One step's outcome: logits for the rows that ran, and the rows the ledger refused (I1)."""

    logits: torch.Tensor | None  # [len(kept), vocab]; None when every row was refused
    kept: list[int]  # indices into the step's rows, in order
    refused: list[int]
    violation: IsolationViolation | None = None


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
        and the step re-run once for the rest. A violation no single row explains is raised."""
        try:
            return Forwarded(self.forward(rows), list(range(len(rows))), [])
        except IsolationViolation as violation:
            refused = self.offending_rows(rows)
            if not refused:
                raise
            kept = [i for i in range(len(rows)) if i not in set(refused)]
            logits = self.forward([rows[i] for i in kept]) if kept else None
            return Forwarded(logits, kept, refused, violation)

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
    fails exactly the refused rows.
    """
    model = steps[0][0].model
    if any(runner.model is not model for runner, _ in steps):
        raise ValueError("forward_together needs runners of one model")
    parts = [(build_forward_batch(r.page_size, rows), r.pool) for r, rows in steps]
    try:
        with torch.inference_mode():
            logits = model.forward_many(parts)
    except IsolationViolation:
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
