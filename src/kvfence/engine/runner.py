"""Runs the model on one step's rows (`RowSpec`s, built into a `ForwardBatch` by the model's builder).

The runner is the only engine code that touches the model. The model records
the slots it writes and verifies every page table against the ledger before
any gather (I1); when that check fails, `offending_rows` names the rows whose
own tables the ledger refuses, so an engine can fail just those and re-run
the step for the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfence.engine.pool import BatchPages, IsolationViolation, KVPool
from kvfence.model.base import CausalLM
from kvfence.model.batching import RowSpec, build_forward_batch


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
