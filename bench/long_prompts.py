"""Long prompts: time to first token and decode rate at 2k, 4k and 8k tokens, same run.

The incident was about long context; `serve_throughput.py` stops at 512-token prompts.
Here every engine serves the SmolLM2-135M geometry (`--preset smollm`, 8,192 positions)
with an 8,192-token context and 1 GiB of KV (kvfence's single process at its own step
budget of 512 tokens and at vLLM's CPU server's 2,048, `kvfence-2048`, and, with
`--engines ...,kvfence-pd`, its sglang-router stack; vLLM CPU float32; llama.cpp f32 GGUF,
one slot of the whole context), one server at a time. For each length, `--repeats`
prompts of random token ids (seeded per length and repeat, so no two share a prefix and
no prefix cache helps) go one at a time, each for `--output` tokens (`ignore_eos`,
greedy, streamed): TTFT is the prefill a long prompt pays; decode tok/s is the output
after the first token over the time after it (attention over the whole long context).

CPU time too: wall TTFT on a shared host says as much about the scheduler as about the
engine (a server whose OpenMP threads busy-wait holds more of the cores under load). So
each prefill is also measured in CPU seconds of the server's whole process tree (every
thread and descendant: vLLM's engine core is a child; see bench/cpu_time.py for how a
process leaving the tree is counted), read from /proc every `--sample` seconds on a
thread and interpolated at the first token. `cores` is those CPU seconds over the TTFT:
the share of the host the server held while it prefilled.

Prints one line per engine and length (medians, with the load average), then per length:
each engine's TTFT p50 and CPU-s p50 with `best_peer/kvfence` for each (>= 1.0: kvfence
at or below the best peer measured in the same run), and the cores each held.

Usage: python bench/long_prompts.py [--lengths 2048,4096,8000] [--repeats 2]
           [--engines kvfence,kvfence-2048,vllm,llamacpp[,kvfence-pd]] [--output 16] [--sample 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.cpu_time import Sampling, TreeMeter, children_of  # noqa: E402
from bench.peers import PeerCache, start_llamacpp, start_vllm  # noqa: E402
from bench.serve_throughput import (  # noqa: E402
    FIRST_ID,
    KV_BYTES,
    Outcome,
    Serving,
    installed,
    one_request,
    pd_stack,
    start_kvfence,
)

from kvfence.model.tiny import PRESETS, default_checkpoint_dir  # noqa: E402

CONTEXT = 8192  # the smollm geometry's positions
# vLLM's CPU API server prefills at most 2,048 tokens a step unless told otherwise
# (max_num_batched_tokens); kvfence's default step budget is 512, which bounds how long a
# step holds every other request's next token. `kvfence-2048` is kvfence at vLLM's budget.
PEER_STEP_BUDGET = 2048
ENGINES = ("kvfence", "kvfence-2048", "vllm", "llamacpp")
EXTRA_ENGINES = ("kvfence-pd",)
OWN = ("kvfence", "kvfence-2048", "kvfence-pd")
PEERS = ("vllm", "llamacpp")


@dataclass(frozen=True, slots=True)
class Shot:
    """One prompt: its outcome and the CPU seconds its prefill took (start to first token)."""

    outcome: Outcome
    prefill_cpu_s: float


@dataclass(frozen=True, slots=True)
class Row:
    engine: str
    length: int
    ttft_ms: float
    decode_tok_s: float
    cpu_s: float  # the server tree's CPU seconds per prefill (p50)
    cores: float  # cpu_s over the TTFT (p50 of each prompt's)
    errors: int
    departed: int  # tree members that exited outside it so far (see bench/cpu_time.py)
    load1: float

    def line(self) -> str:
        gone = f" departed={self.departed}" if self.departed else ""
        return (
            f"  {self.engine:12s} prompt={self.length:5d} ttft_p50_ms={self.ttft_ms:9.1f} "
            f"cpu_s_p50={self.cpu_s:7.2f} cores={self.cores:4.2f} "
            f"decode_tok_s={self.decode_tok_s:7.2f} errors={self.errors}{gone} "
            f"load1={self.load1:.1f}"
        )


def prompt(length: int, repeat: int, seed: int, id_limit: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + length * 101 + repeat)
    return [rng.randrange(FIRST_ID, id_limit) for _ in range(length)]


@contextmanager
def engine(name: str, model_dir: Path, log_dir: Path) -> Iterator[Serving]:
    log_dir.mkdir(parents=True, exist_ok=True)
    if name == "kvfence-pd":
        with pd_stack("tcp", model_dir, log_dir, context=CONTEXT) as serving:
            yield serving
        return
    if name == "kvfence":
        server = start_kvfence(model_dir, log_dir, context=CONTEXT)
    elif name == "kvfence-2048":
        budget = str(PEER_STEP_BUDGET)
        server = start_kvfence(model_dir, log_dir, "--max-batch-tokens", budget, context=CONTEXT)
    elif name == "vllm":
        server = start_vllm(
            model_dir,
            dtype="float32",
            omp_threads_bind="0-1",
            kv_cache_gib=KV_BYTES / (1 << 30),
            max_model_len=CONTEXT,
            enable_prompt_tokens_details=False,
        )
    else:
        server = start_llamacpp(model_dir, ctx_size=CONTEXT, parallel=1, threads=2, outtype="f32")
    with server:
        yield Serving.of(server)


def tree_roots(name: str, serving: Serving) -> tuple[int, ...]:
    """The processes whose trees are the engine: the server, or for the sglang stack every
    process this bench started for it (router, edge and workers are its siblings)."""
    return children_of(os.getpid()) if name == "kvfence-pd" else (serving.pid,)


async def shoot(
    serving: Serving, prompts: list[list[int]], output: int, cpu: Sampling
) -> list[Shot]:
    """One prompt at a time; each prefill's CPU is the tree's between the request's start
    and its first token, read from the sampled timeline."""
    timeout = httpx.Timeout(3600.0, connect=30.0)
    shots = []
    async with httpx.AsyncClient(timeout=timeout, headers=serving.headers) as client:
        for p in serving.render(prompts):
            before = cpu.read().cpu_s
            t0 = time.perf_counter()
            out = await one_request(client, serving.url, serving.model, p, output, True)
            cpu.read()  # a reading after the first token, whatever the sampling's phase
            spent = cpu.cpu_at(t0 + out.ttft_s) - before if out.error is None else float("nan")
            shots.append(Shot(out, spent))
    return shots


def summarise(name: str, length: int, shots: list[Shot], cpu: Sampling, load1: float) -> Row:
    ok = [s for s in shots if s.outcome.error is None]
    for s in shots:
        if s.outcome.error is not None:
            print(f"  {name} prompt={length}: failed: {s.outcome.error}", flush=True)
    outs = [s.outcome for s in ok]
    rates = [
        (o.output_tokens - 1) / (o.latency_s - o.ttft_s)
        for o in outs
        if o.output_tokens > 1 and o.latency_s > o.ttft_s
    ]

    def p50(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    return Row(
        name,
        length,
        p50([o.ttft_s * 1000 for o in outs]),
        p50(rates) if rates else 0.0,
        p50([s.prefill_cpu_s for s in ok]),
        p50([s.prefill_cpu_s / s.outcome.ttft_s for s in ok if s.outcome.ttft_s > 0]),
        len(shots) - len(ok),
        cpu.readings[-1].departed,
        load1,
    )


def measure(
    name: str, serving: Serving, lengths: list[int], args: argparse.Namespace, id_limit: int
) -> list[Row]:
    roots = tree_roots(name, serving)
    with Sampling(TreeMeter(roots), interval_s=args.sample) as cpu:
        print(f"{name}: CPU of {cpu.readings[0].members} processes under {roots}", flush=True)
        warm = asyncio.run(shoot(serving, [prompt(256, 0, args.seed + 1, id_limit)], 4, cpu))
        if warm[0].outcome.error is not None:  # first-call costs, not counted
            raise RuntimeError(f"{name}: warm-up request failed: {warm[0].outcome.error}")
        rows = []
        for length in lengths:
            load1 = os.getloadavg()[0]
            prompts = [prompt(length, r, args.seed, id_limit) for r in range(args.repeats)]
            shots = asyncio.run(shoot(serving, prompts, args.output, cpu))
            row = summarise(name, length, shots, cpu, load1)
            print(row.line(), flush=True)
            rows.append(row)
    return rows


# What `compare` sets side by side: the label it prints, the figure, its format.
FIGURES: tuple[tuple[str, Callable[[Row], float], str], ...] = (
    ("ttft_p50_ms", lambda r: r.ttft_ms, ".0f"),
    ("cpu_s_p50", lambda r: r.cpu_s, ".2f"),
)


def compare(rows: list[Row], length: int) -> None:
    """Per length: each engine's figure and the best peer's over kvfence's (>= 1.0: kvfence
    at or below the best peer), for TTFT and for CPU seconds; then the cores each held."""
    at = {r.engine: r for r in rows if r.length == length}
    ok_peers = [at[p] for p in PEERS if p in at and at[p].errors == 0]
    for label, figure, fmt in FIGURES:
        parts = [f"{e}={figure(r):{fmt}}" for e, r in at.items()]
        best = min((figure(r) for r in ok_peers), default=None)
        for own in OWN:
            if own in at and best is not None:
                parts.append(f"best_peer/{own}={best / figure(at[own]):.3f}")
        print(f"long_prompts prompt={length} {label}: " + " ".join(parts), flush=True)
    cores = " ".join(f"{e}={r.cores:.2f}" for e, r in at.items())
    print(f"long_prompts prompt={length} cores: {cores}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096,8000")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=float, default=0.2, help="seconds between /proc reads")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if not 0.01 <= args.sample <= 5.0:
        ap.error(f"--sample {args.sample} s: give 0.01 to 5 seconds between /proc reads")
    if max(lengths) + args.output > CONTEXT:
        ap.error(f"a prompt of {max(lengths)} + {args.output} output tokens exceeds {CONTEXT}")
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(names) - set(ENGINES + EXTRA_ENGINES)
    if unknown:
        ap.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES + EXTRA_ENGINES}")
    cache = PeerCache.from_env()
    model_dir = default_checkpoint_dir(preset="smollm")
    id_limit = PRESETS["smollm"].tokenizer_size
    print(
        f"long_prompts: lengths={lengths} repeats={args.repeats} output={args.output} "
        f"context={CONTEXT} cores={os.cpu_count()} load1={os.getloadavg()[0]:.1f}",
        flush=True,
    )
    rows: list[Row] = []
    for name in names:
        if name not in OWN and not installed(name, cache):
            print(f"{name}: SKIPPED, not installed in {cache.root} (bench/peers/install.sh)")
            continue
        with engine(name, model_dir, cache.run_dir / "logs") as serving:
            print(f"{name}: ready in {serving.ready_s:.1f} s", flush=True)
            rows += measure(name, serving, lengths, args, id_limit)
    for length in lengths:
        compare(rows, length)


if __name__ == "__main__":
    main()
