"""Prefill attention at long context: the paged prefill kernel against torch's SDPA, one run.

A long prompt is prefilled in chunks (`--chunk` tokens, the engine's step budget); the
chunk at the end of an L-token prompt attends all L keys, so the cost of a long prompt's
attention is mostly chunks like it. For each L in `--lengths` this times one such chunk
(SmolLM2-135M's heads: 9 query heads on 3 KV heads of dim 64, pages of 16, the row's pages
scattered over the pool as the allocator leaves them) through each variant, alternately
(the order rotates each repeat, `--repeats` each):

  kernel: the paged prefill kernel (model.paged_cpu), reading the pool in place
  sdpa:   the pages gathered (index_select through the table) and torch's SDPA with the
          chunk's causal mask (the fallback path of model.attention)
  blocked: the pages gathered, then per KV head and block of 512 keys QK^T and PV as MKL
          matmuls (torch's addmm) with the online softmax between them as torch ops

and prints, per L and variant, the median wall ms, CPU ms of the process (every thread),
the cores held (CPU / wall) and GFLOP per CPU-second (the causal work only: query at
position p times p + 1 keys, QK^T and PV), with the load average. Every variant's output is
compared with SDPA's (the largest max abs difference) so a faster wrong path shows.

With `--prompt N`: one whole N-token prompt through the model instead (the smollm
checkpoint, `--chunk` tokens a forward, as the engine's step budget cuts it), `--repeats`
times: per prompt the wall and CPU seconds of the process, the cores it held (CPU / wall),
and the share of each that attention took (the backend's calls, timed around each), with
the load average.

Usage: python bench/prefill_attention.py [--lengths 2048,4096,8192] [--chunk 512]
           [--threads 2] [--repeats 5]
       python bench/prefill_attention.py --prompt 8192 [--chunk 512] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os

# As `kvfence serve` runs: libgomp's threads sleep when idle instead of spinning on the cores
# the kernels' own threads need (read once, when torch loads libgomp).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfence.kv.pool import KVPool
from kvfence.model.attention import AttentionPlan, CPUAttention
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.paged_cpu import load_prefill
from kvfence.model.tiny import default_checkpoint_dir
from kvfence.serve.process_tuning import keep_freed_heap

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16
BLOCKED_KEYS = 512  # keys per block of the blocked-matmul variant


def _variants(length: int, chunk: int) -> tuple[dict[str, Callable[[], torch.Tensor]], float]:
    gen = torch.Generator().manual_seed(length)
    pages = -(-length // PAGE)
    pool_pages = pages + 64
    k = torch.randn(pool_pages, PAGE, KV_HEADS, DIM, generator=gen)
    v = torch.randn(pool_pages, PAGE, KV_HEADS, DIM, generator=gen)
    table = torch.randperm(pool_pages, generator=gen)[:pages].view(1, -1)
    start = length - chunk
    positions = torch.arange(start, length)
    q = torch.randn(chunk, HEADS, DIM, generator=gen)
    meta = torch.tensor([[0], [0], [chunk], [length]])
    scale = DIM**-0.5
    kernel = load_prefill()
    if kernel is None:
        raise SystemExit("paged prefill kernel not built: python -m kvfence.model.paged_cpu build")
    mask = torch.arange(length)[None, :] <= positions[:, None]

    def run_kernel() -> torch.Tensor:
        out = torch.empty(chunk, HEADS, DIM)
        kernel.attend(q, k, v, table, meta, positions, out, scale)
        return out

    def run_sdpa() -> torch.Tensor:
        flat = table.reshape(-1)
        kk = k.index_select(0, flat).view(1, -1, KV_HEADS, DIM)[:, :length].permute(0, 2, 1, 3)
        vv = v.index_select(0, flat).view(1, -1, KV_HEADS, DIM)[:, :length].permute(0, 2, 1, 3)
        qq = q.permute(1, 0, 2).unsqueeze(0)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].permute(1, 0, 2).contiguous()

    group = HEADS // KV_HEADS
    row_pos = positions.repeat_interleave(group)  # the blocked path's rows: (token, group)

    def run_blocked() -> torch.Tensor:
        flat = table.reshape(-1)
        kk = k.index_select(0, flat).view(-1, KV_HEADS, DIM)[:length]
        vv = v.index_select(0, flat).view(-1, KV_HEADS, DIM)[:length]
        out = torch.empty(chunk, HEADS, DIM)
        for kh in range(KV_HEADS):
            qg = (q[:, kh * group : (kh + 1) * group] * scale).reshape(-1, DIM)
            kt, vk = kk[:, kh].t().contiguous(), vv[:, kh].contiguous()
            m = torch.full((qg.shape[0], 1), float("-inf"))
            total = torch.zeros(qg.shape[0], 1)
            o = torch.zeros(qg.shape[0], DIM)
            for b0 in range(0, length, BLOCKED_KEYS):
                b1 = min(length, b0 + BLOCKED_KEYS)
                sc = qg @ kt[:, b0:b1]
                if b1 > start + 1:  # the block reaches past the chunk's first query
                    sc.masked_fill_(torch.arange(b0, b1)[None, :] > row_pos[:, None], -torch.inf)
                m_new = torch.maximum(m, sc.amax(1, keepdim=True))
                p = sc.sub_(m_new).exp_()
                alpha = (m - m_new).exp_()
                total = total * alpha + p.sum(1, keepdim=True)
                o = torch.addmm(o * alpha, p, vk[b0:b1])
                m = m_new
            out[:, kh * group : (kh + 1) * group] = (o / total).view(chunk, group, DIM)
        return out

    keys = float((positions + 1).sum())
    flops = keys * HEADS * DIM * 4  # QK^T and PV, a multiply and an add each
    return {"kernel": run_kernel, "sdpa": run_sdpa, "blocked": run_blocked}, flops


class _TimedAttention(CPUAttention):
    """The production backend, adding up the wall and process CPU seconds of its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.wall = self.cpu = 0.0

    def attend(
        self,
        pool: KVPool,
        layer: int,
        q: torch.Tensor,
        plan: AttentionPlan,
        *,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return super().attend(pool, layer, q, plan, scale=scale, window=window)
        finally:
            self.cpu += time.process_time() - c0
            self.wall += time.perf_counter() - w0


def whole_prompt(n: int, chunk: int, repeats: int) -> None:
    loaded = load_model(default_checkpoint_dir(preset="smollm"), kind="llama")
    model = loaded.model
    assert isinstance(model, LlamaModel)
    timed = _TimedAttention()
    model.backend = timed
    pool = KVPool(loaded.config.kv_geometry(16), -(-n // 16) + 8)
    gen = torch.Generator().manual_seed(n)
    for rep in range(repeats):
        owner = pool.register_owner(f"prompt-{rep}")
        pages = pool.allocate(owner, pool.geometry.pages_for(n))
        ids = torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
        timed.wall = timed.cpu = 0.0
        load0 = os.getloadavg()[0]
        w0, c0 = time.perf_counter(), time.process_time()
        for start in range(0, n, chunk):
            rows = [RowSpec(pages, owner, ids[start : start + chunk], start)]
            model(build_forward_batch(pool.page_size, rows), pool)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        print(
            f"prompt={n} chunk={chunk} threads={torch.get_num_threads()} wall_s={wall:.2f} "
            f"cpu_s={cpu:.2f} cores={cpu / wall:.2f} attn_wall_s={timed.wall:.2f} "
            f"attn_cpu_s={timed.cpu:.2f} attn_cores={timed.cpu / timed.wall:.2f} "
            f"rest_cores={(cpu - timed.cpu) / (wall - timed.wall):.2f} "
            f"load1={load0:.2f}->{os.getloadavg()[0]:.2f}",
            flush=True,
        )
        pool.release(pages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=0)
    args = ap.parse_args()
    keep_freed_heap()  # as `kvfence serve`: freed activations stay mapped, no refaulting
    torch.set_num_threads(args.threads)
    if args.prompt:
        whole_prompt(args.prompt, args.chunk, args.repeats)
        return
    for length in (int(x) for x in args.lengths.split(",")):
        variants, flops = _variants(length, min(args.chunk, length))
        outs = {name: fn() for name, fn in variants.items()}  # warm up, and compare
        diff = max(float((o - outs["sdpa"]).abs().max()) for o in outs.values())
        wall: dict[str, list[float]] = {n: [] for n in variants}
        cpu: dict[str, list[float]] = {n: [] for n in variants}
        load0 = os.getloadavg()[0]
        names = list(variants)
        for rep in range(args.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                w0, c0 = time.perf_counter(), time.process_time()
                variants[name]()
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
        load1 = os.getloadavg()[0]
        for name in names:
            w, c = statistics.median(wall[name]), statistics.median(cpu[name])
            print(
                f"L={length} chunk={args.chunk} {name:6s} wall_ms={w * 1e3:8.1f} "
                f"cpu_ms={c * 1e3:8.1f} cores={c / w:4.2f} gflop_per_cpu_s={flops / c / 1e9:6.1f} "
                f"max_diff={diff:.2e} load1={load0:.2f}->{load1:.2f}"
            )


if __name__ == "__main__":
    main()
