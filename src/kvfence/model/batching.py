"""Building a `ForwardBatch` from per-row specs: the runner's (and the tests') one way to do it.

Each row names the page table it holds, who reads (its own owner id and the
prefix-cache namespace it may also read), its new token ids and where they
start. Slots are derived from the page table — never given separately — so a
row can only write where its table says (I1 for writes; `begin_step` checks it
again on the model side).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.kv.pool import FREE_OWNER, BatchPages, PageHandle
from kvfence.model.base import ForwardBatch


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One sequence in a step.

    pages: the row's page table in position order (page i holds positions
    i*page_size ..); it must cover start + len(token_ids) positions.
    reader: the row's own owner id; namespace: the prefix-cache namespace it
    may also read (FREE_OWNER when none).
    token_ids: the new tokens, at positions start, start+1, ...
    num_generated: output tokens the row has produced before this step.
    """

    pages: Sequence[PageHandle]
    reader: int
    token_ids: Sequence[int]
    start: int
    num_generated: int = 0
    namespace: int = FREE_OWNER

    @property
    def length(self) -> int:
        """Context length after this step."""
        return self.start + len(self.token_ids)


def rows_of_tokens(query_starts: torch.Tensor) -> torch.Tensor:
    """[T] the row each new token belongs to, from the [B + 1] row offsets.

    A scan, not `repeat_interleave`: that one enters a parallel region even for
    sixteen tokens, and on a loaded machine waking the second thread costs
    milliseconds, twice a step.
    """
    total = int(query_starts[-1])
    inner = query_starts[1:-1]
    marks = torch.zeros(total, dtype=torch.int64)
    marks.index_add_(0, inner[inner < total], torch.ones_like(inner[inner < total]))
    return marks.cumsum_(0)


def build_forward_batch(
    page_size: int, rows: Sequence[RowSpec], *, all_logits: bool = False
) -> ForwardBatch:
    """The flat batch for `rows`: ids, positions, slots from the page tables, page tables.

    Raises ValueError for an empty batch, a row with no new tokens, a negative
    start, or a page table too short for the row's context.
    """
    if not rows:
        raise ValueError("a forward batch needs at least one row")
    for i, r in enumerate(rows):
        if not r.token_ids:
            raise ValueError(f"row {i} has no new tokens")
        if r.start < 0:
            raise ValueError(f"row {i} starts at negative position {r.start}")
        if len(r.pages) * page_size < r.length:
            raise ValueError(
                f"row {i} needs {r.length} positions but its {len(r.pages)} pages hold "
                f"{len(r.pages) * page_size}"
            )
    pages = BatchPages.build(
        [r.pages for r in rows],
        [r.reader for r in rows],
        [r.namespace for r in rows],
        [r.length for r in rows],
    )
    counts = torch.tensor([len(r.token_ids) for r in rows], dtype=torch.int64)
    query_starts = torch.zeros(len(rows) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=query_starts[1:])
    row_of = rows_of_tokens(query_starts)
    starts = torch.tensor([r.start for r in rows], dtype=torch.int64)
    positions = starts[row_of] + torch.arange(int(query_starts[-1])) - query_starts[row_of]
    slot_mapping = pages.pages[row_of, positions // page_size] * page_size + positions % page_size
    input_ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64)
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_starts=query_starts,
        pages=pages,
        num_generated=torch.tensor([r.num_generated for r in rows], dtype=torch.int64),
        all_logits=all_logits,
    )
