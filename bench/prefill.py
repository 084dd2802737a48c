"""Prefill and mixed steps: the model's forward with its prefill path vs a baseline, one run.

Seeded. Builds the checkpoint (`--preset`, default smollm: SmolLM2-135M
geometry, float32) in a temp dir and times, on the caller's thread, model
forwards of two kinds:

  prefill: one prompt per step, `--lengths` tokens each (whole prompt, from 0)
  mixed:   a 256-token chunk of a prompt that already has 256 tokens cached,
           plus 16 decode rows (one token each, 256 cached), in one forward

under each variant, interleaved (the order rotates each repeat, `--repeats`
each), medians compared against `before`:

  prod:        production (linears above SMALL_TOKENS rows through oneDNN with
               packed weights, RMSNorm and RoPE as one C++ pass each, prefill
               attention through the paged prefill kernel, model.paged_cpu)
  sdpa-attn:   production, but prefill attention as torch's SDPA over the
               gathered pages (the path before the paged prefill kernel)
  onednn-only: oneDNN linears, torch's RMSNorm and RoPE, SDPA attention
  before:      torch's F.linear (MKL), torch's RMSNorm and RoPE, SDPA attention
               (the path before any of them; the few-token kernels and the
               paged decode kernel stay in every variant)

Every variant runs the I1 checks (`begin_step`) in every step. Prints one line
per workload:

  prefill kind=prefill tokens=256 prod_ms=... onednn-only_ms=... before_ms=...
  speedup_prod=... speedup_onednn-only=... prod_ms_per_token=... max_logit_diff=... load1=a->b

Usage: python bench/prefill.py [--threads 2] [--lengths 64 256 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os

# As `kvfence serve` runs (cli.py): libgomp's threads sleep when idle instead of spinning on
# the cores the kernels' own threads (spin_pool) need between two oneDNN matmuls.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfence.kv.pool import KVPool
from kvfence.model.attention import CPUAttention
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.linear_cpu import CPULinear
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.rows_cpu import RowOps
from kvfence.model.tiny import make_tiny_checkpoint

Step = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Variant:
    linear: CPULinear  # its `rows` are the variant's RMSNorm/RoPE
    attention: CPUAttention


def _row(pool: KVPool, ids: list[int], start: int, capacity: int) -> RowSpec:
    owner = pool.register_owner(f"bench-{len(ids)}-{start}")
    pages = pool.allocate(owner, pool.geometry.pages_for(capacity))
    return RowSpec(pages, owner, ids, start)


def prefill_step(model: LlamaModel, pool: KVPool, n: int, gen: torch.Generator) -> Step:
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
    batch = build_forward_batch(pool.page_size, [_row(pool, ids, 0, n)])
    return lambda: model(batch, pool)


def mixed_step(model: LlamaModel, pool: KVPool, gen: torch.Generator) -> Step:
    """A 256-token second chunk and 16 decode rows, all with 256 tokens of context cached."""
    vocab = model.config.vocab_size
    rows = []
    for i in range(17):
        n = 512 if i == 0 else 257
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        row = _row(pool, ids, 0, n)
        model(
            build_forward_batch(pool.page_size, [RowSpec(row.pages, row.reader, ids[:256], 0)]),
            pool,
        )
        rows.append(RowSpec(row.pages, row.reader, ids[256:], 256))
    batch = build_forward_batch(pool.page_size, rows)
    return lambda: model(batch, pool)


def time_variants(
    model: LlamaModel, step: Step, variants: dict[str, Variant], repeats: int
) -> tuple[dict[str, float], float]:
    """Median ms per variant (order rotated each repeat), and the largest logit difference."""
    ms: dict[str, list[float]] = {name: [] for name in variants}
    out: dict[str, torch.Tensor] = {}
    names = list(variants)
    for rep in range(repeats + 1):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            model.linear, model.backend = variants[name].linear, variants[name].attention
            t0 = time.perf_counter()
            out[name] = step()
            if rep > 0:  # the first round warms up (and packs the weights once)
                ms[name].append((time.perf_counter() - t0) * 1e3)
    ref = out["before"]
    diff = max(float((o - ref).abs().max()) for o in out.values())
    return {n: statistics.median(v) for n, v in ms.items()}, diff


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smollm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, preset=args.preset)
        loaded = load_model(d, kind="llama")
    model = loaded.model
    assert isinstance(model, LlamaModel)
    torch_rows = RowOps(kernel=False)
    paged = model.backend
    assert isinstance(paged, CPUAttention) and paged.prefill_kernel is not None, (
        "the paged prefill kernel is not built: python -m kvfence.model.paged_cpu build"
    )
    sdpa = CPUAttention()
    sdpa.prefill_kernel = None  # prefill rows gather; decode rows keep the paged kernel
    variants: dict[str, Variant] = {
        "prod": Variant(model.linear, paged),
        "sdpa-attn": Variant(model.linear, sdpa),
        "onednn-only": Variant(CPULinear(rows=torch_rows), sdpa),
        "before": Variant(CPULinear(onednn=False, rows=torch_rows), sdpa),
    }
    gen = torch.Generator().manual_seed(args.seed)
    work: list[tuple[str, int, Step]] = []
    pages = sum(-(-n // 16) for n in args.lengths) + 17 * 33 + 8
    pool = KVPool(loaded.config.kv_geometry(16), pages)
    for n in args.lengths:
        work.append(("prefill", n, prefill_step(model, pool, n, gen)))
    work.append(("mixed", 256 + 16, mixed_step(model, pool, gen)))
    for kind, tokens, step in work:
        load0 = os.getloadavg()[0]
        ms, diff = time_variants(model, step, variants, args.repeats)
        base = ms["before"]
        print(
            f"prefill kind={kind} tokens={tokens} threads={args.threads} repeats={args.repeats} "
            + " ".join(f"{n}_ms={v:.1f}" for n, v in ms.items())
            + " "
            + " ".join(f"speedup_{n}={base / v:.3f}" for n, v in ms.items() if n != "before")
            + f" prod_ms_per_token={ms['prod'] / tokens:.3f} max_logit_diff={diff:.2e} "
            f"load1={load0:.2f}->{os.getloadavg()[0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
