"""The C++ paged prefill kernel: equal to the gather path, reads no slot a query may not see."""

from __future__ import annotations

import pytest
import torch
from kvmodel_helpers import heads_config, make_pool

from kvfence.kv.pool import KVPool
from kvfence.model import paged_cpu
from kvfence.model.attention import AttentionPlan, CPUAttention
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.config import ModelConfig

# Float32 sums in another order than SDPA's: scores of O(10), 200-odd keys.
ATOL = 3e-5

# (head dim, heads, KV heads): every head dim with a kernel, groups 1-8 (SmolLM2's 64 x 9/3
# among them); head dim 24 has none and must take the gather path.
SHAPES = [(16, 6, 2), (32, 8, 2), (64, 9, 3), (128, 4, 4), (64, 8, 1), (24, 4, 2)]
# (cached, new) per row: whole prompts from 0 (one token, under a tile, tile edges, many
# tiles), a chunk after a cached prefix, and a decode row in the same step.
ROWS = [(0, 37), (20, 1), (0, 5), (33, 50), (0, 16), (16, 17), (0, 1), (7, 200)]


def _step(config: ModelConfig, page_size: int) -> tuple[KVPool, AttentionPlan, torch.Tensor]:
    pool = make_pool(config, 200, page_size=page_size)
    pool.k.normal_()
    pool.v.normal_()
    rows = []
    for i, (cached, new) in enumerate(ROWS):
        owner = pool.register_owner(f"r{i}")
        pages = pool.allocate(owner, pool.geometry.pages_for(cached + new))
        rows.append(RowSpec(pages, owner, [1] * new, start=cached))
    batch = build_forward_batch(page_size, rows)
    q = torch.randn(batch.positions.numel(), config.num_heads, config.head_dim) * 2
    return pool, CPUAttention(kernel=False).plan(pool, batch), q


def test_the_prefill_kernel_is_built_for_this_source() -> None:
    assert paged_cpu.load_prefill() is not None, "run: python -m kvfence.model.paged_cpu build"
    assert CPUAttention().prefill_kernel is not None


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("page_size", [16, 4, 3])  # tiles of 16 keys span pages of any size
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}h{}kv{}".format(*s))
def test_prefill_kernel_equals_the_gather_path(
    shape: tuple[int, int, int], page_size: int, window: int | None, threads: int
) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = heads_config(*shape)
    pool, plan, q = _step(config, page_size)
    kernel, reference = CPUAttention(), CPUAttention(kernel=False)
    assert kernel._prefill_in_place(pool, q) == (shape[0] in paged_cpu.PagedPrefillKernel.HEAD_DIMS)
    for layer in range(config.num_layers):
        got = kernel.attend(pool, layer, q, plan, scale=0.25, window=window)
        want = reference.attend(pool, layer, q, plan, scale=0.25, window=window)
        assert (got - want).abs().max() <= ATOL


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_equals_the_gather_path_on_sharp_scores(threads: int) -> None:
    """Scores hundreds apart (queries 40x the usual scale): the base-2 softmax's weights run
    from 1 down past 2^-126, where its exp2 clamps, and still match the gather path's, with
    no NaN or inf. The tolerance is wider because a score of ~500 is itself rounded at ~3e-5."""
    torch.set_num_threads(threads)
    torch.manual_seed(5)
    config = heads_config(64, 9, 3)
    pool, plan, q = _step(config, 16)
    q = q * 40
    kernel, reference = CPUAttention(), CPUAttention(kernel=False)
    assert kernel._prefill_in_place(pool, q)
    for layer in range(config.num_layers):
        got = kernel.attend(pool, layer, q, plan, scale=0.25)
        want = reference.attend(pool, layer, q, plan, scale=0.25)
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("page_size", [16, 3])
def test_prefill_kernel_reads_no_slot_past_a_query(page_size: int) -> None:
    """NaN in every slot a query may not attend (its row's later tokens, the tail of its last
    page, other rows' pages, free pages) changes nothing: those slots are never read, or are
    weighed exactly 0. A kernel that read one tiny weight past a query would turn it NaN."""
    torch.set_num_threads(2)
    torch.manual_seed(1)
    config = heads_config(64, 9, 3)
    pool, plan, q = _step(config, page_size)
    kernel = CPUAttention()
    clean = [kernel.attend(pool, layer, q, plan, scale=0.25) for layer in range(2)]
    batch = plan.batch
    starts = batch.query_starts.tolist()
    for p in plan.prefill:  # one row at a time: poison all it may not see, check its tokens
        saved_k, saved_v = pool.k.clone(), pool.v.clone()
        table = batch.pages.pages[p.row].tolist()
        seen = torch.zeros(pool.k.shape[1] * page_size, dtype=torch.bool)
        for t in range(p.start, p.end):
            pos = int(batch.positions[t])
            assert starts[p.row] <= t < starts[p.row + 1]
            for key in range(min(pos + 1, p.length)):
                seen[table[key // page_size] * page_size + key % page_size] = True
        for layer in range(2):
            flat_k = pool.k[layer].view(-1, pool.k.shape[-2], pool.k.shape[-1])
            flat_v = pool.v[layer].view(-1, pool.v.shape[-2], pool.v.shape[-1])
            flat_k[~seen] = float("nan")
            flat_v[~seen] = float("nan")
        for layer in range(2):
            got = kernel.attend(pool, layer, q, plan, scale=0.25)[p.start : p.end]
            assert torch.isfinite(got).all(), f"row {p.row} read a slot it may not attend"
            assert torch.equal(got, clean[layer][p.start : p.end])
        pool.k.copy_(saved_k)
        pool.v.copy_(saved_v)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_refuses_a_table_entry_outside_the_pool(threads: int) -> None:
    torch.set_num_threads(threads)
    kernel = paged_cpu.load_prefill()
    assert kernel is not None
    k = torch.zeros(4, 2, 1, 16)
    q = torch.zeros(3, 2, 16)
    meta = torch.tensor([[0], [0], [3], [3]])  # row 0, tokens [0, 3), 3 keys
    out = torch.full((3, 2, 16), 7.0)
    for bad in (4, -1):  # past the last page of a 4-page pool; negative
        table = torch.tensor([[0, bad]], dtype=torch.int64)  # key 2 lies on the bad entry
        with pytest.raises(ValueError, match="outside the pool"):
            kernel.attend(q, k, k.clone(), table, meta, torch.arange(3), out, 1.0)
        assert torch.all(out == 7.0), "nothing is written when an entry is refused"


@pytest.mark.parametrize("shape", [(64, 9, 3), (32, 8, 2)], ids=lambda s: "d{}h{}kv{}".format(*s))
def test_prefill_kernel_reads_q_in_place_from_a_wider_projection(
    shape: tuple[int, int, int],
) -> None:
    """q as the model passes it: a view into the fused qkv output (token rows wider than
    heads x head dim), read at its own stride with no copy, gives bit for bit the result of the
    same q laid out contiguously. Reading it at the contiguous stride would mix tokens' heads."""
    torch.set_num_threads(2)
    torch.manual_seed(2)
    config = heads_config(*shape)
    pool, plan, q = _step(config, 16)
    t, heads, hd = q.shape
    fused = torch.randn(t, heads * hd + 2 * config.num_kv_heads * hd)
    fused[:, : heads * hd] = q.reshape(t, -1)
    view = fused[:, : heads * hd].view(t, heads, hd)
    assert not view.is_contiguous() and view.stride(0) == fused.shape[1]
    kernel = CPUAttention()
    assert kernel._prefill_in_place(pool, view)
    for layer in range(2):
        got = kernel.attend(pool, layer, view, plan, scale=0.25)
        assert torch.equal(got, kernel.attend(pool, layer, q.contiguous(), plan, scale=0.25))


# Long context: rows whose keys reach past the kernel's long-row threshold (2,048 keys), where
# it takes longer query blocks. Lengths are off every page, tile and block multiple: a prompt
# from 0, chunks after a cached prefix (one crossing the threshold, one at 3k), a short row
# and a decode row at long context in the same step.
LONG_ROWS = [(0, 2101), (2040, 97), (2999, 333), (0, 45), (2500, 1)]


def _long_step(page_size: int) -> tuple[KVPool, AttentionPlan, torch.Tensor]:
    config = heads_config(64, 9, 3)
    need = sum(-(-(c + n) // page_size) for c, n in LONG_ROWS)
    pool = make_pool(config, need + 8, page_size=page_size)
    pool.k.normal_()
    pool.v.normal_()
    rows = []
    for i, (cached, new) in enumerate(LONG_ROWS):
        owner = pool.register_owner(f"long{i}")
        pages = pool.allocate(owner, pool.geometry.pages_for(cached + new))
        rows.append(RowSpec(pages, owner, [1] * new, start=cached))
    batch = build_forward_batch(page_size, rows)
    q = torch.randn(batch.positions.numel(), config.num_heads, config.head_dim) * 2
    return pool, CPUAttention(kernel=False).plan(pool, batch), q


@pytest.mark.parametrize(
    ("page_size", "window", "threads"), [(16, None, 2), (3, 777, 2), (16, 777, 1), (3, None, 1)]
)
def test_prefill_kernel_equals_the_gather_path_at_long_context(
    page_size: int, window: int | None, threads: int
) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(3)
    pool, plan, q = _long_step(page_size)
    kernel, reference = CPUAttention(), CPUAttention(kernel=False)
    assert kernel._prefill_in_place(pool, q)
    got = kernel.attend(pool, 0, q, plan, scale=0.125, window=window)
    want = reference.attend(pool, 0, q, plan, scale=0.125, window=window)
    assert (got - want).abs().max() <= ATOL


def test_prefill_kernel_reads_no_slot_past_a_long_row() -> None:
    """As above at long context: NaN in every slot no token of a row may attend (other rows'
    pages, its last page's tail, free pages) leaves that row's output unchanged."""
    torch.set_num_threads(2)
    torch.manual_seed(4)
    page_size = 16
    pool, plan, q = _long_step(page_size)
    kernel = CPUAttention()
    clean = kernel.attend(pool, 0, q, plan, scale=0.125)
    batch = plan.batch
    for p in plan.prefill:
        top = min(int(batch.positions[p.start : p.end].max()) + 1, p.length)
        table = batch.pages.pages[p.row]
        keys = torch.arange(top)
        seen = torch.zeros(pool.k.shape[1] * page_size, dtype=torch.bool)
        seen[table[keys // page_size] * page_size + keys % page_size] = True
        saved_k, saved_v = pool.k[0].clone(), pool.v[0].clone()
        pool.k[0].view(-1, 3, 64)[~seen] = float("nan")
        pool.v[0].view(-1, 3, 64)[~seen] = float("nan")
        got = kernel.attend(pool, 0, q, plan, scale=0.125)[p.start : p.end]
        assert torch.isfinite(got).all(), f"row {p.row} read a slot it may not attend"
        assert torch.equal(got, clean[p.start : p.end])
        pool.k[0].copy_(saved_k)
        pool.v[0].copy_(saved_v)
