"""Decode attention: the paged kernel (in place) vs the gather path (padded copy), same run.

Seeded. Builds the smollm-geometry checkpoint (random weights) in a temp dir,
prefills `--rows` requests of 64-512 random tokens into one pool, then times,
interleaved, (a) the model's whole decode forward over all rows and (b) the
attention of all layers alone, with `CPUAttention()` (the kernel's vector path),
`CPUAttention(vector=False)` (its scalar path, what shapes without a vector path
run) and `CPUAttention(kernel=False)` (gather + SDPA, the reference). Prints one
line per measurement with the minimum and median of `--repeats` and the ratios
scalar / kernel and gather / kernel, the 1-minute load average, and the largest
logit difference from the gather path;
then the I1 prologue (`begin_step`: the write check, the written marks and the
ledger verify, once per step) as a share of the kernel's decode forward.

Usage: python bench/decode_attention.py [--preset smollm|tiny] [--rows 16] [--threads 2]
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
from kvfence.model.attention import CPUAttention, begin_step
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.tiny import make_tiny_checkpoint


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smollm")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, preset=args.preset)
        model = load_model(d, kind="llama").model
    assert isinstance(model, LlamaModel)
    geometry = model.config.kv_geometry(page_size=16)
    pool = KVPool(geometry, args.rows * 34)
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(args.rows):
        n = int(torch.randint(64, 513, (1,), generator=g))
        owner = pool.register_owner(f"r{i}")
        pages = pool.allocate(owner, geometry.pages_for(n + 1))
        ids = torch.randint(16, model.config.vocab_size, (n,), generator=g).tolist()
        model(build_forward_batch(16, [RowSpec(pages, owner, ids, 0)]), pool)
        rows.append(RowSpec(pages, owner, [7], start=n))
    batch = build_forward_batch(16, rows)
    backends = {
        "kernel": CPUAttention(),
        "scalar": CPUAttention(vector=False),
        "gather": CPUAttention(kernel=False),
    }
    assert backends["kernel"].kernel is not None, (
        "build it: python -m kvfence.model.paged_cpu build"
    )
    c = model.config
    q = torch.randn(args.rows, c.num_heads, c.head_dim)
    fwd: dict[str, list[float]] = {k: [] for k in backends}
    att: dict[str, list[float]] = {k: [] for k in backends}
    logits = {}
    for _ in range(args.repeats):
        for name, backend in backends.items():
            model.backend = backend
            plan = backend.plan(pool, batch)
            logits[name] = model(batch, pool)  # also the warm-up of the first repeat
            fwd[name] += timed(lambda: model(batch, pool), 1)
            att[name] += timed(
                lambda b=backend, p=plan: [
                    b.attend(pool, i, q, p, scale=model.scale) for i in range(c.num_layers)
                ],
                1,
            )
    prologue = timed(lambda: begin_step(pool, batch), args.repeats * 4)
    diff = max(float((logits[n] - logits["gather"]).abs().max()) for n in ("kernel", "scalar"))
    load = os.getloadavg()[0]
    context = int(batch.pages.lengths.sum())
    for label, data in (("decode_forward", fwd), ("attention_all_layers", att)):
        best = {n: min(v) * 1e3 for n, v in data.items()}
        times = " ".join(
            f"{n}_ms=min {best[n]:.1f} med {statistics.median(v) * 1e3:.1f}"
            for n, v in data.items()
        )
        print(
            f"{label} preset={args.preset} rows={args.rows} context_tokens={context} "
            f"threads={args.threads} {times} scalar/kernel={best['scalar'] / best['kernel']:.2f} "
            f"gather/kernel={best['gather'] / best['kernel']:.2f} max_logit_diff={diff:.1e} "
            f"load1={load:.1f}"
        )
    i1_us = statistics.median(prologue) * 1e6
    fwd_us = statistics.median(fwd["kernel"]) * 1e6
    print(
        f"i1_prologue_us={i1_us:.0f} decode_forward_us={fwd_us:.0f} "
        f"isolation_share={100 * i1_us / fwd_us:.2f}% (goal <= 1%) load1={load:.1f}"
    )


if __name__ == "__main__":
    main()
