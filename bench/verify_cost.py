"""What the I1 read check costs: one decode step's `pool.verify` vs the paged gather it guards.

Seeded. A Llama-3-8B-like KV geometry (32 layers, 8 KV heads, head dim 128,
page size 16, bf16): 64 requests x 16 pages each, every page owned, written
and current, so verify does its full work and passes. Per step it times

  verify: `pool.verify(batch)` once for the whole batch (all rows, all pages);
  gather: K and V gathered through the same page tables for all 32 layers
          (what paged attention reads; the baseline, measured in the same run).

Each is repeated and the median kept. Prints one line:

  verify_us=... gather_us=... ratio=...%   (target: ratio < 1%)

Usage: python bench/verify_cost.py [--requests 64] [--pages 16] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import FREE_OWNER, BatchPages, KVPool

GEOMETRY = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")


def build(requests: int, pages_per_request: int) -> tuple[KVPool, BatchPages]:
    pool = KVPool(GEOMETRY, requests * pages_per_request + requests)  # a little slack
    gen = torch.Generator().manual_seed(0)
    for t in (pool.k, pool.v):  # real bytes, so the gather moves real data
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype))
    tables, readers = [], []
    for r in range(requests):
        owner = pool.register_owner(f"req-{r}")
        handles = pool.allocate(owner, pages_per_request)
        pool.mark_written(
            torch.tensor([h.index for h in handles]),
            torch.full((pages_per_request,), GEOMETRY.page_size),
        )
        tables.append(handles)
        readers.append(owner)
    tokens = pages_per_request * GEOMETRY.page_size
    batch = BatchPages.build(tables, readers, [FREE_OWNER] * requests, [tokens] * requests)
    return pool, batch


def gather(pool: KVPool, pages: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Every layer's K and V for every page of the batch, through the page tables."""
    for layer in range(pool.geometry.num_layers):
        torch.index_select(pool.k[layer], 0, pages, out=k_out)
        torch.index_select(pool.v[layer], 0, pages, out=v_out)


def median_us(fn: object, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--pages", type=int, default=16, help="pages per request")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    pool, batch = build(args.requests, args.pages)
    flat = batch.pages[batch.valid]
    shape = (flat.numel(), *pool.k.shape[2:])
    k_out = torch.empty(shape, dtype=pool.k.dtype)
    v_out = torch.empty(shape, dtype=pool.v.dtype)
    pool.verify(batch)  # warm-up, and proof the batch is legitimate
    gather(pool, flat, k_out, v_out)
    verify_samples, gather_samples = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        verify_samples.append(median_us(lambda: pool.verify(batch), 20))
        gather_samples.append(median_us(lambda: gather(pool, flat, k_out, v_out), 1))
    verify_us = statistics.median(verify_samples)
    gather_us = statistics.median(gather_samples)
    kv_gib = 2 * pool.k.numel() * pool.k.element_size() / 2**30
    print(
        f"verify_us={verify_us:.1f} gather_us={gather_us:.1f} "
        f"ratio={100 * verify_us / gather_us:.3f}% "
        f"(rows={args.requests} pages/row={args.pages} pool_kv={kv_gib:.2f}GiB "
        f"threads={torch.get_num_threads()})"
    )


if __name__ == "__main__":
    main()
