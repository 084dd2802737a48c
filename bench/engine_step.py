"""Per-step engine overhead: a decode step of 16 rows vs the model forward inside it.

Seeded. Builds the tiny checkpoint in a temp dir, runs 16 requests (128-token
prompts, 64 greedy output tokens) through the in-process pipeline on the
caller's thread, and times every decode step with all 16 rows running. The
baseline, measured in the same run, is the model's own forward call inside
those steps (batch already built). Prints one line:

  engine_step rows=16 step_ms=... forward_ms=... overhead_ms=... (batch_build_ms=...
  scheduler+sampler_ms=...) overhead_pct=...

With `--mixed`, instead: mixed batches vs separate prefill/decode forwards
(`EngineConfig.mixed_batches`), measured in the same run. A closed loop keeps
`--concurrency` requests in the pipeline (seeded prompts of 64-512 tokens and
32-96 greedy output tokens, so requests end at different steps and new
prompts arrive while others decode; `--requests` in all); the two modes alternate,
`--repeats` times each, and the medians are compared. Prints one line per run
and one result line:

  engine_mixed preset=... mixed_tok_s=... separate_tok_s=... ratio=... forwards ...
  ttft_p50_ms ... load1=...

With `--compare ledger`: the same decode steps with the I1 ledger check on
(production) vs the lab's `no-ledger-check` fault; `--compare linear`: the
few-token linear kernel vs torch's linear (both layer by layer); `--compare fused`:
a decode step's layers in one kernel call vs one call per kernel. At each `--levels` row count the
two alternate `--repeats` times (order flipped each repeat), medians compared.
Beside it, far less sensitive to machine load: the I1 checks' own time (the kernel's
`StepChecks.passes`, and `check_step` where the reference runs; both include marking the
step's writes, which runs either way) as a share of each production step, timed inside the same
steps:

  engine_compare preset=... rows=... ledger_step_ms=... no-ledger_step_ms=...
  step_ratio_ledger/no-ledger=... (cost_of_ledger=...%) i1_checks_share_of_step=...%
  load1=...

Usage: python bench/engine_step.py [--preset tiny|smollm] [--threads N]
       python bench/engine_step.py --compare ledger|linear|fused [--preset smollm] [--threads 2]
       python bench/engine_step.py --mixed [--preset smollm] [--requests 24] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

import kvfence.engine.runner as runner_module
import kvfence.model.attention as attention_module
from kvfence.engine.backend import GenerateWork
from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import Failure, SamplingParams
from kvfence.faults import Fault, FaultSet
from kvfence.model.linear_cpu import CPULinear
from kvfence.model.loader import load_model
from kvfence.model.step_checks import StepChecks
from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.serve.pipeline import CollectingSink, LocalPipeline
from kvfence.transfer.link import inprocess_link


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


def _ended(sink: CollectingSink) -> bool:
    last = sink.events[-1] if sink.events else None
    return isinstance(last, Failure) or (last is not None and last.finish_reason is not None)


@dataclasses.dataclass(slots=True)
class _Run:
    wall_s: float
    tokens: int
    forwards: int
    ttft_ms: list[float]


@dataclasses.dataclass(slots=True)
class _Live:
    sink: CollectingSink
    start: float
    first: bool = False


def _closed_loop(
    pipe: LocalPipeline,
    prompts: list[tuple[tuple[int, ...], int]],
    concurrency: int,
    count: list[int],
) -> _Run:
    """Keep `concurrency` requests in the pipeline until every prompt has been served."""
    pending = list(enumerate(prompts))
    live: list[_Live] = []
    ttft: list[float] = []
    sinks: list[CollectingSink] = []
    count[0] = 0
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, (prompt, out_len) = pending.pop(0)
            sampling = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
            sinks.append(CollectingSink())
            pipe.submit(
                GenerateWork(f"r{i}", f"t{i % 4}", prompt, sampling, f"t{i % 4}"), sinks[-1]
            )
            live.append(_Live(sinks[-1], time.perf_counter()))
        pipe.pump()
        now = time.perf_counter()
        for entry in live:
            if entry.sink.events and not entry.first:
                entry.first = True
                ttft.append((now - entry.start) * 1e3)
        live = [e for e in live if not _ended(e.sink)]
    wall = time.perf_counter() - t0
    tokens = sum(len(s.wait(0).token_ids) for s in sinks)
    return _Run(wall, tokens, count[0], ttft)


def mixed_vs_separate(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, preset=args.preset)
        loaded = load_model(d, kind="llama")
    count = [0]
    inner = loaded.model.forward_many

    def counted(parts: Any) -> Any:
        count[0] += 1
        return inner(parts)

    loaded.model.forward_many = counted  # type: ignore[method-assign]
    rng = random.Random(args.seed)
    vocab = loaded.config.vocab_size
    prompts = [
        (
            tuple(rng.randrange(16, vocab) for _ in range(rng.randrange(64, 513))),
            rng.randrange(32, 97),
        )
        for _ in range(args.requests)
    ]
    pages = args.concurrency * (512 + 96) // 16 + 64
    geometry = loaded.config.kv_geometry(page_size=16)
    runs: dict[bool, list[_Run]] = {True: [], False: []}
    load0 = os.getloadavg()[0]
    for rep in range(args.repeats):
        for mixed in (True, False) if rep % 2 == 0 else (False, True):
            config = EngineConfig(
                prefill_pages=pages, decode_pages=pages, page_size=16,
                max_running=args.concurrency, mixed_batches=mixed, prefix_cache=False,
            )  # fmt: skip
            pipe = LocalPipeline(loaded.model, geometry, config, kv_link=inprocess_link)
            r = _closed_loop(pipe, prompts, args.concurrency, count)
            pipe.check_integrity()
            runs[mixed].append(r)
            print(
                f"  run mixed={mixed} wall_s={r.wall_s:.2f} tok_s={r.tokens / r.wall_s:.2f} "
                f"forwards={r.forwards} ttft_p50_ms={statistics.median(r.ttft_ms):.0f} "
                f"load1={os.getloadavg()[0]:.2f}",
                flush=True,
            )
    tok = {m: statistics.median(r.tokens / r.wall_s for r in runs[m]) for m in runs}
    ttft = {m: statistics.median(statistics.median(r.ttft_ms) for r in runs[m]) for m in runs}
    fwd = {m: statistics.median(r.forwards for r in runs[m]) for m in runs}
    print(
        f"engine_mixed preset={args.preset} requests={args.requests} "
        f"concurrency={args.concurrency} threads={args.threads} repeats={args.repeats} "
        f"mixed_tok_s={tok[True]:.2f} separate_tok_s={tok[False]:.2f} "
        f"ratio={tok[True] / tok[False]:.3f} forwards_mixed={fwd[True]:.0f} "
        f"forwards_separate={fwd[False]:.0f} ttft_p50_ms_mixed={ttft[True]:.0f} "
        f"ttft_p50_ms_separate={ttft[False]:.0f} load1_start={load0:.2f} "
        f"load1_end={os.getloadavg()[0]:.2f}"
    )


@dataclasses.dataclass(slots=True)
class _Steps:
    step_ms: float  # median decode step with every row running
    forward_ms: float  # the model's forward inside those steps
    build_ms: float
    steps: int
    i1_share: float  # median over those steps of (I1 checks' time) / (step time)


class _I1Clock:
    """Seconds spent in the I1 checks (`StepChecks.passes`, `check_step`) while installed."""

    def __init__(self) -> None:
        self.s = 0.0

    def wrap(self, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s += time.perf_counter() - t0

        return timed


@contextlib.contextmanager
def i1_clock(clock: _I1Clock) -> Iterator[None]:
    reference, kernel = attention_module.check_step, StepChecks.passes
    attention_module.check_step = clock.wrap(reference)
    StepChecks.passes = clock.wrap(kernel)  # type: ignore[method-assign]
    try:
        yield
    finally:
        attention_module.check_step = reference
        StepChecks.passes = kernel  # type: ignore[method-assign]


def decode_steps(
    model: torch.nn.Module, geometry: Any, rows: int, faults: FaultSet, vocab: int
) -> _Steps:
    """`rows` requests (128-token prompts, 64 greedy tokens) through the pipeline; decode steps timed."""
    pages = 13 * rows  # 128 prompt + 64 output tokens = 12 pages per request, plus slack
    # Decode steps alone (all rows run once prefill is done): the two-forward path.
    config = EngineConfig(
        prefill_pages=pages, decode_pages=pages, page_size=16, max_running=rows,
        mixed_batches=False,
    )  # fmt: skip
    timed = TimedModel(model)
    pipe = LocalPipeline(timed, geometry, config, faults, kv_link=inprocess_link)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    for i in range(rows):
        prompt = tuple(torch.randint(3, vocab, (128,), generator=g).tolist())
        sampling = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        pipe.submit(
            GenerateWork(f"r{i}", f"t{i % 4}", prompt, sampling, f"t{i % 4}"), CollectingSink()
        )
    steps: list[float] = []
    forwards: list[float] = []
    shares: list[float] = []
    decode_step = pipe.decode.step
    clock = _I1Clock()

    def timed_step() -> None:
        full = len(pipe.decode.running) == rows
        i1_before = clock.s
        t0 = time.perf_counter()
        decode_step()
        if full:
            steps.append(time.perf_counter() - t0)
            forwards.append(timed.last_s)
            shares.append((clock.s - i1_before) / steps[-1])

    builds: list[float] = []
    real_build = runner_module.build_forward_batch

    def timed_build(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = real_build(*a, **kw)
        builds.append(time.perf_counter() - t0)
        return out

    runner_module.build_forward_batch = timed_build
    pipe.decode.step = timed_step  # type: ignore[method-assign]
    try:
        with i1_clock(clock):
            pipe.drive()
    finally:
        runner_module.build_forward_batch = real_build
    pipe.check_integrity()
    return _Steps(
        statistics.median(steps) * 1e3,
        statistics.median(forwards) * 1e3,
        statistics.median(builds) * 1e3,
        len(steps),
        statistics.median(shares),
    )


def compare(args: argparse.Namespace, loaded: Any) -> None:
    """Decode steps at each `--levels` row count: A vs B interleaved, medians, ratio B/A."""
    model, geometry = loaded.model, loaded.config.kv_geometry(page_size=16)
    vocab = loaded.config.vocab_size
    kernel_linear, torch_linear = model.linear, CPULinear(kernel=False)
    fused = model.fused
    # name -> (faults, linear, fused decode on)
    variants: dict[str, tuple[FaultSet, CPULinear, bool]] = {
        "ledger": {"ledger": (FaultSet(), kernel_linear, True),
                   "no-ledger": (FaultSet.of(Fault.NO_LEDGER_CHECK), kernel_linear, True)},
        "linear": {"kernel": (FaultSet(), kernel_linear, False),
                   "torch": (FaultSet(), torch_linear, False)},
        "fused": {"fused": (FaultSet(), kernel_linear, True),
                  "per-layer": (FaultSet(), kernel_linear, False)},
    }[args.compare]  # fmt: skip
    load0 = os.getloadavg()[0]
    for rows in args.levels:
        ms: dict[str, list[float]] = {name: [] for name in variants}
        share: list[float] = []
        for rep in range(args.repeats):
            order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
            for name in order:
                faults, linear, fuse = variants[name]
                model.linear, model.fused = linear, fused if fuse else None
                r = decode_steps(model, geometry, rows, faults, vocab)
                ms[name].append(r.step_ms)
                if not faults:
                    share.append(r.i1_share)
        a, b = (statistics.median(ms[n]) for n in variants)
        na, nb = variants
        print(
            f"engine_compare preset={args.preset} threads={args.threads} rows={rows} "
            f"repeats={args.repeats} {na}_step_ms={a:.2f} {nb}_step_ms={b:.2f} "
            f"{na}_tok_s={rows * 1e3 / a:.1f} {nb}_tok_s={rows * 1e3 / b:.1f} "
            f"step_ratio_{na}/{nb}={a / b:.3f} (cost_of_{na}={100 * (a / b - 1):+.2f}%) "
            f"i1_checks_share_of_step={100 * statistics.median(share):.3f}% "
            f"load1={load0:.2f}->{os.getloadavg()[0]:.2f}",
            flush=True,
        )
    model.linear, model.fused = kernel_linear, fused


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--mixed", action="store_true", help="mixed batches vs separate forwards")
    ap.add_argument(
        "--compare",
        choices=("ledger", "linear", "fused"),
        help="decode steps with the I1 ledger check on vs the lab's no-ledger-check, the "
        "few-token linear kernel vs torch's linear (layer by layer), or every layer in one "
        "call vs one call per kernel, interleaved at each of --levels",
    )
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.mixed:
        mixed_vs_separate(args)
        return
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, preset=args.preset)
        loaded = load_model(d, kind="llama")
    if args.compare:
        compare(args, loaded)
        return
    geometry = loaded.config.kv_geometry(page_size=16)
    r = decode_steps(loaded.model, geometry, args.rows, FaultSet(), loaded.config.vocab_size)
    over = r.step_ms - r.forward_ms
    print(
        f"engine_step preset={args.preset} rows={args.rows} steps={r.steps} "
        f"step_ms={r.step_ms:.3f} forward_ms={r.forward_ms:.3f} overhead_ms={over:.3f} "
        f"(batch_build_ms={r.build_ms:.3f} scheduler+sampler_ms={over - r.build_ms:.3f}) "
        f"overhead_pct={100 * over / r.step_ms:.1f} forward/step={r.forward_ms / r.step_ms:.3f} "
        f"load1={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
