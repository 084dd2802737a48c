"""The paged step: slots derived from page tables, writes confined to them, one verify per step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kvmodel_helpers import make_pool, new_seq, step

from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import IsolationViolation, KVPool
from kvfence.model.attention import available_backends, gather, get_backend
from kvfence.model.base import CausalLM, ForwardBatch
from kvfence.model.batching import RowSpec, build_forward_batch, rows_of_tokens
from kvfence.model.config import ModelConfig
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.mirror import MirrorModel

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=512,
    hidden_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=64,
)


def test_build_forward_batch_derives_slots_from_page_tables() -> None:
    pool = make_pool(CONFIG, 8, page_size=4)
    o1, o2 = pool.register_owner("a"), pool.register_owner("b")
    p1, p2 = pool.allocate(o1, 2), pool.allocate(o2, 3)
    batch = build_forward_batch(
        4, [RowSpec(p1, o1, [1, 2, 3], start=3), RowSpec(p2, o2, [9], start=9, num_generated=2)]
    )
    assert batch.positions.tolist() == [3, 4, 5, 9]
    assert batch.query_starts.tolist() == [0, 3, 4]
    expected = [p1[0].index * 4 + 3, p1[1].index * 4, p1[1].index * 4 + 1, p2[2].index * 4 + 1]
    assert batch.slot_mapping.tolist() == expected
    assert batch.pages.lengths.tolist() == [6, 10] and batch.num_generated.tolist() == [0, 2]
    with pytest.raises(ValueError, match="needs 9 positions"):
        build_forward_batch(4, [RowSpec(p1, o1, [1], start=8)])
    with pytest.raises(ValueError, match="no new tokens"):
        build_forward_batch(4, [RowSpec(p1, o1, [], start=0)])


def _forged_write(pool: KVPool) -> tuple[KVPool, int]:
    model = MirrorModel(CONFIG)
    a, b = new_seq(pool, [1, 2], 16), new_seq(pool, [3, 4], 16)
    batch = build_forward_batch(16, [RowSpec(b.pages, b.owner, [3, 4], 0)])
    # Aim B's second token at A's page: a write outside B's page table.
    slots = batch.slot_mapping.clone()
    slots[1] = a.pages[0].index * 16
    model(replace(batch, slot_mapping=slots), pool)
    return pool, a.pages[0].index


def test_a_write_outside_the_rows_page_table_is_refused() -> None:
    pool = make_pool(CONFIG, 4)
    with pytest.raises(IsolationViolation, match="writes outside its page table"):
        _forged_write(pool)
    assert float(pool.k.abs().sum()) == 0.0  # refused before anything was written


def test_the_write_check_is_what_stops_it() -> None:
    pool, victim = _forged_write(make_pool(CONFIG, 4, faults=FaultSet.of(Fault.NO_LEDGER_CHECK)))
    assert float(pool.k[0, victim].abs().sum()) > 0  # B's token landed in A's page


def _two_pools_second_stale(
    tiny_checkpoint: Path,
) -> tuple[LlamaModel, list[tuple[ForwardBatch, KVPool]], KVPool]:
    """Two pools' batches for one forward; the second row's page was reused under it."""
    loaded = load_model(tiny_checkpoint)
    assert isinstance(loaded.model, LlamaModel)
    first, second = make_pool(loaded.config, 8), make_pool(loaded.config, 8)
    a, b = new_seq(first, [5, 6, 7], 16), new_seq(second, [8, 9], 16)
    second.generation[b.pages[0].index] += 1  # b's handle is stale: the ledger must refuse it
    parts = [
        (build_forward_batch(16, [RowSpec(a.pages, a.owner, a.tokens, 0)]), first),
        (build_forward_batch(16, [RowSpec(b.pages, b.owner, b.tokens, 0)]), second),
    ]
    return loaded.model, parts, first


def test_one_forward_over_two_pools_verifies_both_before_writing_either(
    tiny_checkpoint: Path,
) -> None:
    model, parts, first = _two_pools_second_stale(tiny_checkpoint)
    with pytest.raises(IsolationViolation):
        model.forward_many(parts)
    assert float(first.k.abs().sum()) == 0.0  # the first pool was not written either (I1)


def test_the_part_by_part_default_would_have_written_the_first_pool(tiny_checkpoint: Path) -> None:
    """Negative control for the test above: the base class's one-by-one loop writes part 1 first."""
    model, parts, first = _two_pools_second_stale(tiny_checkpoint)
    with pytest.raises(IsolationViolation):
        CausalLM.forward_many(model, parts)
    assert float(first.k.abs().sum()) > 0.0


def test_decode_rows_batched_equal_each_row_alone(tiny_checkpoint: Path) -> None:
    """One padded SDPA call for many decode rows gives each row what it gets alone."""
    loaded = load_model(tiny_checkpoint)
    pool = make_pool(loaded.config, 32)
    prompts = [[(7 * i + j) % 500 for j in range(n)] for i, n in enumerate([3, 40, 17])]
    seqs = [new_seq(pool, p, len(p) + 1) for p in prompts]
    for s in seqs:
        step(loaded.model, pool, [(s, len(s.tokens))])
        s.tokens.append(11)
    alone = []
    for s in seqs:
        alone.append(step(loaded.model, pool, [(s, 1)])[0])
        s.cached -= 1  # rewind: the same slot is written again with the same K/V
    together = step(loaded.model, pool, [(s, 1) for s in seqs])
    assert torch.allclose(together, torch.stack(alone), atol=1e-5, rtol=0)


def test_gather_reads_only_the_table_and_backends_are_named() -> None:
    pool = make_pool(CONFIG, 4, page_size=2)
    pool.k[0] = torch.arange(4, dtype=torch.float32)[:, None, None, None].expand(4, 2, 2, 16)
    o = pool.register_owner("x")
    pages = pool.allocate(o, 4)
    batch = build_forward_batch(2, [RowSpec([pages[3], pages[1]], o, [1, 2, 3, 4], 0)])
    k, _ = gather(pool, 0, batch.pages)
    assert k[0, :, 0, 0].tolist() == [pages[3].index] * 2 + [pages[1].index] * 2
    assert available_backends() == ["cpu"]
    with pytest.raises(ValueError, match="available: cpu"):
        get_backend("triton")


@pytest.mark.parametrize("counts", [[1], [1, 1, 1], [3, 1, 4], [1, 0, 2], [2, 0, 0], [0, 5]])
def test_token_rows_are_derived_from_the_row_offsets(counts: list[int]) -> None:
    starts = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(counts), 0, out=starts[1:])
    want = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    assert rows_of_tokens(starts).tolist() == want.tolist()
