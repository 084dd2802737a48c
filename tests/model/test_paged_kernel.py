"""The C++ paged decode kernel: built at install, equal to the gather path, never reads off the pool."""

from __future__ import annotations

import pytest
import torch
from kvmodel_helpers import make_pool

from kvfence.model import paged_cpu
from kvfence.model.attention import CPUAttention
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.config import ModelConfig

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=512,
    hidden_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=64,
)


def test_the_kernel_is_built_for_this_source() -> None:
    # `make install` builds it; a missing build is a failure here, not a silent fallback.
    assert paged_cpu.library_path().exists(), "run: python -m kvfence.model.paged_cpu build"
    assert paged_cpu.load() is not None
    assert CPUAttention().kernel is not None


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_equals_the_gather_path_on_decode_rows(window: int | None, threads: int) -> None:
    torch.set_num_threads(threads)  # 3: rows' heads taken one by one on the pool's threads
    torch.manual_seed(0)
    pool = make_pool(CONFIG, 40, page_size=4)
    pool.k.normal_()
    pool.v.normal_()
    rows = []
    for i, length in enumerate([1, 3, 4, 9, 30]):
        owner = pool.register_owner(f"r{i}")
        pages = pool.allocate(owner, pool.geometry.pages_for(length))
        rows.append(RowSpec(pages, owner, [1], start=length - 1))
    batch = build_forward_batch(4, rows)
    q = torch.randn(len(rows), CONFIG.num_heads, CONFIG.head_dim)
    kernel, reference = CPUAttention(), CPUAttention(kernel=False)
    assert kernel.kernel is not None and reference.kernel is None
    plan = reference.plan(pool, batch)
    for layer in range(CONFIG.num_layers):
        got = kernel.attend(pool, layer, q, plan, scale=0.25, window=window)
        want = reference.attend(pool, layer, q, plan, scale=0.25, window=window)
        assert torch.allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_refuses_a_table_entry_outside_the_pool(threads: int) -> None:
    torch.set_num_threads(threads)
    kernel = paged_cpu.load()
    assert kernel is not None
    k = torch.zeros(4, 2, 1, 8)
    table = torch.tensor([[0, 4]], dtype=torch.int64)  # page 4 of a 4-page pool
    with pytest.raises(ValueError, match="outside the pool"):
        kernel.attend(
            torch.zeros(1, 2, 8), k, k.clone(), table, torch.tensor([0]), torch.tensor([4]), 1.0
        )
