"""The C++ paged decode kernel: built at install, equal to the gather path, never reads off the pool."""

from __future__ import annotations

import pytest
import torch
from kvmodel_helpers import heads_config, make_pool

from kvfence.model import paged_cpu
from kvfence.model.attention import CPUAttention
from kvfence.model.batching import RowSpec, build_forward_batch


def test_the_kernel_is_built_for_this_source() -> None:
    # `make install` builds it; a missing build is a failure here, not a silent fallback.
    assert paged_cpu.library_path().exists(), "run: python -m kvfence.model.paged_cpu build"
    assert paged_cpu.load() is not None
    assert CPUAttention().kernel is not None


# (head dim, heads, KV heads): the vector path's dims and groups (SmolLM2's 64 x 9/3 among
# them), and shapes it does not take (head dim 24; a group of 16), which run the scalar path.
SHAPES = [(16, 6, 2), (32, 8, 2), (64, 9, 3), (128, 4, 4), (64, 8, 1), (24, 4, 2), (16, 16, 1)]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}h{}kv{}".format(*s))
def test_kernel_equals_the_gather_path_on_decode_rows(
    window: int | None, threads: int, shape: tuple[int, int, int]
) -> None:
    torch.set_num_threads(threads)  # 3: rows' heads taken one by one on the pool's threads
    torch.manual_seed(0)
    config = heads_config(*shape)
    pool = make_pool(config, 60, page_size=4)
    pool.k.normal_()
    pool.v.normal_()
    rows = []
    # Lengths: within one page, page edges, and a window that starts mid-page.
    for i, length in enumerate([1, 3, 4, 9, 30, 61]):
        owner = pool.register_owner(f"r{i}")
        pages = pool.allocate(owner, pool.geometry.pages_for(length))
        rows.append(RowSpec(pages, owner, [1], start=length - 1))
    batch = build_forward_batch(4, rows)
    q = torch.randn(len(rows), config.num_heads, config.head_dim) * 2  # peaked softmax too
    kernel, reference = CPUAttention(), CPUAttention(kernel=False)
    assert kernel.kernel is not None and reference.kernel is None
    plan = reference.plan(pool, batch)
    lo, hi = plan.decode_bounds(window)
    for layer in range(config.num_layers):
        got = kernel.attend(pool, layer, q, plan, scale=0.25, window=window)
        want = reference.attend(pool, layer, q, plan, scale=0.25, window=window)
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
        scalar = kernel.kernel.attend(
            q.view(len(rows), config.num_heads, config.head_dim), pool.k[layer], pool.v[layer],
            batch.pages.pages, lo, hi, 0.25, vector=False,
        )  # fmt: skip
        assert torch.allclose(scalar.reshape(got.shape), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("head_dim", [8, 64])  # 64 takes the vector path unless told not to
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_refuses_a_table_entry_outside_the_pool(
    threads: int, head_dim: int, vector: bool
) -> None:
    torch.set_num_threads(threads)
    kernel = paged_cpu.load()
    assert kernel is not None
    k = torch.zeros(4, 2, 1, head_dim)
    for bad in (4, -1):  # past the last page of a 4-page pool; negative
        table = torch.tensor([[0, bad]], dtype=torch.int64)
        with pytest.raises(ValueError, match="outside the pool"):
            kernel.attend(
                torch.zeros(1, 2, head_dim), k, k.clone(), table,
                torch.tensor([0]), torch.tensor([4]), 1.0, vector=vector,
            )  # fmt: skip


# Lengths past the kernel's shortest span (256 keys) and off every page and tile edge.
@pytest.mark.parametrize("lengths", [[600], [517], [4099], [1, 2049], [5, 700, 1000]])
@pytest.mark.parametrize("window", [None, 700])
def test_long_rows_split_over_key_spans_equal_torch(lengths: list[int], window: int | None) -> None:
    # Few rows on 2 threads: each (row, KV head) is cut into spans of keys and merged.
    torch.set_num_threads(2)
    torch.manual_seed(1)
    config = heads_config(64, 9, 3)
    pool = make_pool(config, sum(-(-n // 16) for n in lengths) + 2, page_size=16)
    pool.k.normal_()
    pool.v.normal_()
    rows = []
    for i, length in enumerate(lengths):
        owner = pool.register_owner(f"r{i}")
        pages = pool.allocate(owner, pool.geometry.pages_for(length))
        rows.append(RowSpec(pages, owner, [1], start=length - 1))
    batch = build_forward_batch(16, rows)
    q = torch.randn(len(rows), config.num_heads, config.head_dim) * 2
    kernel = paged_cpu.load()
    assert kernel is not None
    plan = CPUAttention(kernel=False).plan(pool, batch)
    lo, hi = plan.decode_bounds(window)
    for vector in (True, False):
        got = kernel.attend(q, pool.k[0], pool.v[0], batch.pages.pages, lo, hi, 0.125, vector)
        for r, length in enumerate(lengths):  # torch over the row's keys, read by hand
            slots = [int(batch.pages.pages[r, p // 16]) * 16 + p % 16 for p in range(length)]
            a = int(lo[r])
            k = pool.k[0].view(-1, 3, 64)[slots[a:]].repeat_interleave(3, dim=1)
            v = pool.v[0].view(-1, 3, 64)[slots[a:]].repeat_interleave(3, dim=1)
            want = torch.softmax(torch.einsum("hd,khd->hk", q[r], k) * 0.125, -1)
            want = torch.einsum("hk,khd->hd", want, v)
            assert torch.allclose(got[r], want, atol=2e-5, rtol=0), (length, vector)
