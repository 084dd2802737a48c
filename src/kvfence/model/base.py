"""The contract between the engine's runner and a model.

A model never owns KV memory and never sees a request: it gets a flat batch of
new tokens, where to write their K/V in the pool (`slot_mapping`), and the
page tables it may read (`pages`). It verifies the page tables against the
ledger once per step before any gather (I1) — `pool.verify(batch.pages)` —
and then reads K/V only through those tables. Before verifying it checks that
every slot lies in its own row's table and records the slots it fills with
`pool.mark_written` (`model.attention.begin_step`); callers need not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.kv.pool import BatchPages, KVPool


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One forward step over B sequences with T new tokens in all.

    input_ids, positions, slot_mapping: [T] (slot = page * page_size + offset).
    query_starts: [B + 1] offsets of each row's new tokens in the flat arrays.
    pages: the rows' page tables; pages.lengths = context length after this step.
    num_generated: [B] output tokens each row has produced so far (0 in prefill).
    all_logits: return logits for every new token ([T, V]) instead of each row's last ([B, V]).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_starts: torch.Tensor
    pages: BatchPages
    num_generated: torch.Tensor
    all_logits: bool = False

    @property
    def num_rows(self) -> int:
        return int(self.query_starts.numel()) - 1


class CausalLM(ABC, torch.nn.Module):
    """A decoder that reads and writes KV only through a `KVPool`."""

    @abstractmethod
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Write the new tokens' K/V at `batch.slot_mapping`, verify, attend through `batch.pages`.

        Returns float32 logits: [B, vocab] (each row's last new token) or
        [T, vocab] when `batch.all_logits`.
        """

    def forward_many(self, parts: Sequence[tuple[ForwardBatch, KVPool]]) -> list[torch.Tensor]:
        """One step over several pools' batches (prefill's and decode's): logits per part, in order.

        A model that can reads its weights once for all parts and verifies every
        part's page tables (I1) before it writes or reads any of them; this
        default runs the parts one after the other, each verified before its own reads.
        """
        return [self.forward(batch, pool) for batch, pool in parts]
