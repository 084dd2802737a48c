"""Prefill scheduling on a burst: step budget and admission order, in-process, one run.

Seeded. Loads the `--preset` checkpoint (default smollm: SmolLM2-135M geometry,
float32; made on first use), then submits a burst of `--prompts` prompts
(64-512 random token ids, as `serve_throughput.py` draws them) at once to the
in-process pipeline (mixed batches, the I1 checks on), `--output-tokens` greedy
tokens each, and drives it to the end on the caller's thread: no HTTP, so the
scheduler's effect is not buried in the server's noise. Variants, each
`budget/order`, run interleaved (the order rotates each repeat), `--repeats`
each; the baseline is `2048/arrival`, the policy before stop 24. Prints one line
per run and one result line per variant:

  burst variant=512/shortest wall_s=... out_tok_s=... ttft_p50_ms=... ttft_p99_ms=...
  steps=... vs_baseline: tok_s=...x ttft_p50=...x load1=...

With `--output-tokens 1` the burst is prefill only: wall_s / prompt tokens is
prefill's cost a token under each budget.

Usage: python bench/burst.py [--preset smollm] [--prompts 16] [--output-tokens 64]
           [--variants 2048/arrival,2048/shortest,512/arrival,512/shortest] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass

import torch

from kvfence.engine.backend import GenerateWork
from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import Failure, SamplingParams, TokenChunk
from kvfence.engine.prefill_order import PrefillOrder
from kvfence.model.loader import LoadedModel, load_model
from kvfence.model.tiny import PRESETS, default_checkpoint_dir
from kvfence.serve.pipeline import CollectingSink, LocalPipeline
from kvfence.transfer.link import inprocess_link

BASELINE = "2048/arrival"


class TimedSink(CollectingSink):
    """A sink that also notes when its request's first token arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.first_s: float | None = None

    def __call__(self, event: TokenChunk | Failure) -> None:
        if self.first_s is None and isinstance(event, TokenChunk) and event.token_ids:
            self.first_s = time.perf_counter()
        super().__call__(event)


@dataclass(frozen=True)
class Run:
    wall_s: float
    out_tokens: int
    ttfts_ms: list[float]
    steps: int


def prompts(n: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(64, 513))) for _ in range(n)]


def run_burst(
    loaded: LoadedModel, variant: str, burst: list[tuple[int, ...]], output_tokens: int, tag: str
) -> Run:
    budget, order = variant.split("/")
    total = sum(len(p) for p in burst) + len(burst) * output_tokens
    pages = -(-total // 16) + 2 * len(burst)
    config = EngineConfig(
        prefill_pages=pages,
        decode_pages=pages,
        max_batch_tokens=int(budget),
        prefill_order=PrefillOrder(order),
        context_length=1024,
    )
    geometry = loaded.config.kv_geometry(page_size=config.page_size)
    pipe = LocalPipeline(loaded.model, geometry, config, None, kv_link=inprocess_link)
    sampling = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    sinks = [TimedSink() for _ in burst]
    t0 = time.perf_counter()
    for i, (prompt, sink) in enumerate(zip(burst, sinks, strict=True)):
        pipe.submit(GenerateWork(f"{tag}-{i}", "t", prompt, sampling, "t"), sink)
    steps = pipe.drive()
    wall = time.perf_counter() - t0
    results = [s.wait(0) for s in sinks]
    if any(r.error is not None for r in results):
        raise RuntimeError(f"{variant}: a request failed: {[r.error for r in results]}")
    ttfts = [((s.first_s or t0) - t0) * 1e3 for s in sinks]
    return Run(wall, sum(len(r.token_ids) for r in results), ttfts, steps)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--variants", default="2048/arrival,2048/shortest,512/arrival,512/shortest")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    variants = args.variants.split(",")
    if BASELINE not in variants:
        variants.insert(0, BASELINE)
    torch.set_num_threads(args.threads)
    loaded = load_model(default_checkpoint_dir(preset=args.preset), kind="llama")
    burst = prompts(args.prompts, PRESETS[args.preset].tokenizer_size, args.seed)
    print(
        f"burst preset={args.preset} prompts={len(burst)} prompt_tokens={sum(map(len, burst))} "
        f"output_tokens={args.output_tokens} load1={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    run_burst(loaded, BASELINE, burst[:2], 2, "warm-up")
    runs: dict[str, list[Run]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            r = run_burst(loaded, v, burst, args.output_tokens, f"{v}-{rep}")
            runs[v].append(r)
            print(
                f"  {v:>14} rep={rep} wall_s={r.wall_s:.2f} "
                f"ttft_p50_ms={statistics.median(r.ttfts_ms):.0f} steps={r.steps}",
                flush=True,
            )
    base_tok = statistics.median(r.out_tokens / r.wall_s for r in runs[BASELINE])
    base_ttft = statistics.median(statistics.median(r.ttfts_ms) for r in runs[BASELINE])
    for v, rs in runs.items():
        tok = statistics.median(r.out_tokens / r.wall_s for r in rs)
        ttft = statistics.median(statistics.median(r.ttfts_ms) for r in rs)
        print(
            f"burst variant={v} wall_s={statistics.median(r.wall_s for r in rs):.2f} "
            f"out_tok_s={tok:.1f} ttft_p50_ms={ttft:.0f} "
            f"ttft_p99_ms={statistics.median(p99(r.ttfts_ms) for r in rs):.0f} "
            f"steps={rs[0].steps} vs_baseline: tok_s={tok / base_tok:.3f}x "
            f"ttft_p50={ttft / base_ttft:.3f}x load1={os.getloadavg()[0]:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
