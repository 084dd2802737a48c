"""Long prompts: time to first token and decode rate at 2k, 4k and 8k tokens, same run.

The incident was about long context; `serve_throughput.py` stops at 512-token prompts.
Here every engine serves the SmolLM2-135M geometry (`--preset smollm`, 8,192 positions)
with an 8,192-token context and 1 GiB of KV (kvfence's single process and, with
`--engines ...,kvfence-pd`, its sglang-router stack; vLLM CPU float32; llama.cpp f32 GGUF,
one slot of the whole context), one server at a time. For each length, `--repeats`
prompts of random token ids (seeded per length and repeat, so no two share a prefix and
no prefix cache helps) go one at a time, each for `--output` tokens (`ignore_eos`,
greedy, streamed): TTFT is the prefill a long prompt pays; decode tok/s is the output
after the first token over the time after it (attention over the whole long context).

Prints one line per engine and length (medians, with the load average), then one line per
length: each engine's TTFT p50 and `best_peer/kvfence` (>= 1.0: kvfence's TTFT at or
below the best peer's).

Usage: python bench/long_prompts.py [--lengths 2048,4096,8000] [--repeats 2]
           [--engines kvfence,vllm,llamacpp[,kvfence-pd]] [--output 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers import PeerCache, start_llamacpp, start_vllm  # noqa: E402
from bench.serve_throughput import (  # noqa: E402
    FIRST_ID,
    KV_BYTES,
    Serving,
    installed,
    pd_stack,
    run_level,
    start_kvfence,
)

from kvfence.model.tiny import PRESETS, default_checkpoint_dir  # noqa: E402

CONTEXT = 8192  # the smollm geometry's positions
ENGINES = ("kvfence", "vllm", "llamacpp")
EXTRA_ENGINES = ("kvfence-pd",)
PEERS = ("vllm", "llamacpp")


@dataclass(frozen=True, slots=True)
class Row:
    engine: str
    length: int
    ttft_ms: float
    decode_tok_s: float
    errors: int
    load1: float

    def line(self) -> str:
        return (
            f"  {self.engine:10s} prompt={self.length:5d} ttft_p50_ms={self.ttft_ms:9.1f} "
            f"decode_tok_s={self.decode_tok_s:7.1f} errors={self.errors} load1={self.load1:.1f}"
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


def measure(
    name: str, serving: Serving, lengths: list[int], args: argparse.Namespace, id_limit: int
) -> list[Row]:
    def send(prompts: list[list[int]], output: int) -> list[tuple[float, float, int, str | None]]:
        outs, _ = asyncio.run(
            run_level(
                serving.url, serving.model, serving.render(prompts), 1, output, True,
                serving.headers,
            )
        )  # fmt: skip
        return [(o.ttft_s, o.latency_s, o.output_tokens, o.error) for o in outs]

    warm = send([prompt(256, 0, args.seed + 1, id_limit)], 4)  # first-call costs, not counted
    if warm[0][3] is not None:
        raise RuntimeError(f"{name}: warm-up request failed: {warm[0][3]}")
    rows = []
    for length in lengths:
        load1 = os.getloadavg()[0]
        outs = send(
            [prompt(length, r, args.seed, id_limit) for r in range(args.repeats)], args.output
        )
        ok = [o for o in outs if o[3] is None]
        for o in outs:
            if o[3] is not None:
                print(f"  {name} prompt={length}: failed: {o[3]}", flush=True)
        ttft = statistics.median(o[0] * 1000 for o in ok) if ok else float("nan")
        rates = [(n - 1) / (lat - t) for t, lat, n, _ in ok if n > 1 and lat > t]
        row = Row(
            name,
            length,
            ttft,
            statistics.median(rates) if rates else 0.0,
            len(outs) - len(ok),
            load1,
        )
        print(row.line(), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096,8000")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
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
        if name != "kvfence-pd" and not installed(name, cache):
            print(f"{name}: SKIPPED, not installed in {cache.root} (bench/peers/install.sh)")
            continue
        with engine(name, model_dir, cache.run_dir / "logs") as serving:
            print(f"{name}: ready in {serving.ready_s:.1f} s", flush=True)
            rows += measure(name, serving, lengths, args, id_limit)
    for length in lengths:
        at = {r.engine: r for r in rows if r.length == length}
        parts = [f"{e}={r.ttft_ms:.0f}" for e, r in at.items()]
        peers = [at[p].ttft_ms for p in PEERS if p in at and at[p].errors == 0]
        if "kvfence" in at and peers:
            parts.append(f"best_peer/kvfence={min(peers) / at['kvfence'].ttft_ms:.3f}")
        if "kvfence-pd" in at and peers:
            parts.append(f"best_peer/kvfence-pd={min(peers) / at['kvfence-pd'].ttft_ms:.3f}")
        print(f"long_prompts prompt={length} ttft_p50_ms: " + " ".join(parts), flush=True)


if __name__ == "__main__":
    main()
