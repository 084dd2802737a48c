"""Per-step engine overhead: a decode step of 16 rows vs the model forward inside it.

Seeded. Builds the tiny checkpoint in a temp dir, runs 16 requests (128-token
prompts, 64 greedy output tokens) through the in-process pipeline on the
caller's thread, and times every decode step with all 16 rows running. The
baseline, measured in the same run, is the model's own forward call inside
those steps (batch already built). Prints one line:

  engine_step rows=16 step_ms=... forward_ms=... overhead_ms=... (batch_build_ms=...
  scheduler+sampler_ms=...) overhead_pct=...

Usage: python bench/engine_step.py [--preset tiny|smollm] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

import kvfence.engine.runner as runner_module
from kvfence.engine.backend import GenerateWork
from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import SamplingParams
from kvfence.engine.pipeline import CollectingSink, LocalPipeline
from kvfence.model.loader import load_model
from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.serve.transfer.link import inprocess_link


class TimedModel(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.last_s = 0.0

    def forward(self, *args: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner(*args)
        self.last_s = time.perf_counter() - t0
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, preset=args.preset)
        loaded = load_model(d, kind="llama")
    pages = 13 * args.rows  # 128 prompt + 64 output tokens = 12 pages per request, plus slack
    config = EngineConfig(
        prefill_pages=pages, decode_pages=pages, page_size=16, max_running=args.rows
    )
    timed = TimedModel(loaded.model)
    geometry = loaded.config.kv_geometry(page_size=16)
    pipe = LocalPipeline(timed, geometry, config, kv_link=inprocess_link)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    vocab = loaded.config.vocab_size
    for i in range(args.rows):
        prompt = tuple(torch.randint(3, vocab, (128,), generator=g).tolist())
        sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        pipe.submit(
            GenerateWork(f"r{i}", f"t{i % 4}", prompt, sampling, f"t{i % 4}"), CollectingSink()
        )
    steps: list[float] = []
    forwards: list[float] = []
    decode_step = pipe.decode.step

    def timed_step() -> None:
        full = len(pipe.decode.running) == args.rows
        t0 = time.perf_counter()
        decode_step()
        if full:
            steps.append(time.perf_counter() - t0)
            forwards.append(timed.last_s)

    builds: list[float] = []
    real_build = runner_module.build_forward_batch

    def timed_build(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = real_build(*a, **kw)
        builds.append(time.perf_counter() - t0)
        return out

    runner_module.build_forward_batch = timed_build  # type: ignore[assignment]
    pipe.decode.step = timed_step  # type: ignore[method-assign]
    pipe.drive()
    pipe.check_integrity()
    step_ms = statistics.median(steps) * 1e3
    fwd_ms = statistics.median(forwards) * 1e3
    over = step_ms - fwd_ms
    build_ms = statistics.median(builds) * 1e3
    print(
        f"engine_step preset={args.preset} rows={args.rows} steps={len(steps)} "
        f"step_ms={step_ms:.3f} forward_ms={fwd_ms:.3f} overhead_ms={over:.3f} "
        f"(batch_build_ms={build_ms:.3f} scheduler+sampler_ms={over - build_ms:.3f}) "
        f"overhead_pct={100 * over / step_ms:.1f} forward/step={fwd_ms / step_ms:.3f}"
    )


if __name__ == "__main__":
    main()
