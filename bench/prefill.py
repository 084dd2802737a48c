"""Prefill and mixed steps: the model's forward with its prefill path vs a baseline, one run.

Seeded. Builds the checkpoint (`--preset`, default smollm: SmolLM2-135M
geometry, float32) in a temp dir and times, on the caller's thread, model
forwards of two kinds:

  prefill: one prompt per step, `--lengths` tokens each (whole prompt, from 0)
  mixed:   a 256-token chunk of a prompt that already has 256 tokens cached,
           plus 16 decode rows (one token each, 256 cached), in one forward

under each variant, interleaved (ABBA, `--repeats` each), medians compared.
Variants: `onednn` (production: linears above SMALL_TOKENS rows through
oneDNN with packed weights) against `mkl` (torch's F.linear, the path before
it). Both variants run the I1 checks (`begin_step`) in every step. Prints one
line per workload:

  prefill kind=prefill tokens=256 onednn_ms=... mkl_ms=... speedup=... onednn_ms_per_token=...
  max_logit_diff=... load1=a->b

Usage: python bench/prefill.py [--threads 2] [--lengths 64 256 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from kvfence.kv.pool import KVPool
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.linear_cpu import CPULinear
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.tiny import make_tiny_checkpoint

Step = Callable[[], torch.Tensor]


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
    model: LlamaModel, step: Step, variants: dict[str, CPULinear], repeats: int
) -> tuple[dict[str, float], float]:
    """Median ms per variant (ABBA order), and the largest logit difference between them."""
    ms: dict[str, list[float]] = {name: [] for name in variants}
    out: dict[str, torch.Tensor] = {}
    for rep in range(repeats + 1):
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for name in order:
            model.linear = variants[name]
            t0 = time.perf_counter()
            out[name] = step()
            if rep > 0:  # the first round warms up (and packs the weights once)
                ms[name].append((time.perf_counter() - t0) * 1e3)
    a, b = out.values()
    return {n: statistics.median(v) for n, v in ms.items()}, float((a - b).abs().max())


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
    variants = {"onednn": model.linear, "mkl": CPULinear(onednn=False)}
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
        a, b = ms["onednn"], ms["mkl"]
        print(
            f"prefill kind={kind} tokens={tokens} threads={args.threads} repeats={args.repeats} "
            f"onednn_ms={a:.1f} mkl_ms={b:.1f} speedup={b / a:.3f} "
            f"onednn_ms_per_token={a / tokens:.3f} max_logit_diff={diff:.2e} "
            f"load1={load0:.2f}->{os.getloadavg()[0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
