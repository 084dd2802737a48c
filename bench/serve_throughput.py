"""Serving throughput: kvfence vs vLLM CPU vs llama.cpp on the same checkpoint, same run.

Seeded workload: N requests per concurrency level (default 64; prompts of 64-512 random
token ids sent as ids, 64 output tokens, `ignore_eos`, temperature 0), streamed over
`/v1/completions` with `stream_options.include_usage`, at concurrency 1, 4 and 16. Every
level draws its own prompts, so no engine's prefix cache can reuse one level's prompts in
the next. The engines serve the SAME Hugging Face checkpoint (llama.cpp an f32 GGUF
converted from it), one server at a time:

  kvfence   `kvfence serve --model DIR --no-auth` (1 GiB KV pool per role)
  kvfence-noledger  the same with `--lab-fault no-ledger-check` (the I1 checks off): the
            cost of isolation in the serving path is kvfence / kvfence-noledger (goal >= 0.99)
  kvfence-fcfs  the same with `--prefill-order arrival` (prompts admitted first come, first
            served, instead of shortest first): the scheduling policy's effect on TTFT and
            throughput, same run (not in the default list)
  vLLM      CPU build, `--dtype float32`, `VLLM_CPU_OMP_THREADS_BIND=0-1`, 1 GiB KV
  llama.cpp `llama-server -t 2 -np 16 -c 16384` (1,024 tokens per slot), f32 GGUF
  kvfence-pd  kvfence's disaggregated stack: the real sglang-router (PD mode) in front of one
            prefill and one decode `kvfence serve --router sglang` worker (1 GiB KV each;
            they take turns on the 2 cores, each step on both), KV over TCP;
            `kvfence-pd-mooncake` and `kvfence-pd-nixl` the same with the Mooncake and NIXL
            transfer engines. The router takes text prompts only (token ids get a 422), so
            these rows send each prompt's ids as text, trimmed until it encodes to at most the
            same number of tokens (the prompt tokens sent are printed); requests carry a tenant
            key (the workers authenticate every request, I10).
            `kvfence-pd-noedge` (not in the default list): the same stack with the router itself
            on the public address, without kvfence's edge in front: the edge's cost, same run.
            `kvfence-pd-split` (not in the default list): the same stack with the cores split
            for good, one a worker, both stepping at once (`StackSpec(share_cores=False)`):
            the turns' effect, same run
  vllm-pd   vLLM's own disaggregated fleet (bench/peers/pd_fleet.py): a prefill and a decode
            vLLM CPU server (float32, NixlConnector over DRAM, each pinned to one core) behind
            vllm-router, 1 GiB of KV blocks each; prompts as text, as for kvfence-pd

Output tokens are counted from each stream's `usage`; TTFT is the time to the first
event that carries a choice. Requests ask for `logprobs: 1` (all engines alike): random
weights mostly pick ids the checkpoint's small tokenizer has no text for, and kvfence and
vLLM send no event for a token without text, so without logprobs the first event would
come at the end of the stream (`--no-logprobs` turns it off). Throughput is all output tokens of a level over its wall
time. The 1-minute load average is printed next to every figure (the machine is shared).
Prints one line per engine and level, then one result line per level with the ratios
kvfence/vLLM and kvfence/llama.cpp (the goal is >= 1.0), pd/kvfence (the disaggregated
stack against the single-process engine, same run) and each engine's TTFT p50. With
`--repeats N` every engine runs N times, in passes one after another, and the result
lines give the medians (a single run on this shared machine varies by +-20%).

Usage: python bench/serve_throughput.py [--preset smollm|tiny] [--requests N]
           [--engines kvfence,kvfence-pd,kvfence-pd-mooncake,vllm,llamacpp] [--quick]
           [--profile-kvfence OUT.txt] [--repeats N] [--kvfence-arg=--max-batch-tokens=N ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers import (  # noqa: E402
    PeerCache,
    PeerServer,
    free_port,
    launch_server,
    start_llamacpp,
    start_vllm,
)

from kvfence.model.tiny import PRESETS, default_checkpoint_dir  # noqa: E402
from kvfence.model.tokenizer import Tokenizer  # noqa: E402

ENGINES = (
    "kvfence",
    "kvfence-noledger",
    "kvfence-pd",
    "kvfence-pd-mooncake",
    "kvfence-pd-nixl",
    "vllm",
    "vllm-pd",
    "llamacpp",
)
EXTRA_ENGINES = ("kvfence-fcfs", "kvfence-pd-noedge", "kvfence-pd-split")
PD_TRANSPORTS = {
    "kvfence-pd": "tcp",
    "kvfence-pd-mooncake": "mooncake",
    "kvfence-pd-nixl": "nixl",
    "kvfence-pd-noedge": "tcp",
    "kvfence-pd-split": "tcp",
}
KV_BYTES = 1 << 30  # every engine gets 1 GiB of KV (vLLM's VLLM_CPU_KVCACHE_SPACE=1)
CONTEXT = 2048
VLLM_BLOCK = 128  # vLLM CPU's KV block, in tokens
LLAMA_SLOTS = 16
LLAMA_CTX = 16384
# Prompt ids avoid the special tokens at the start of the vocabulary and stay inside the
# tokenizer (vLLM rejects ids the tokenizer does not know).
FIRST_ID = 16


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int
    prompt_min: int
    prompt_max: int
    output_tokens: int
    levels: tuple[int, ...]
    seed: int
    logprobs: bool

    def prompts(self, level_index: int, id_limit: int) -> list[list[int]]:
        """The level's prompts: seeded per level, so levels never share a prefix."""
        rng = random.Random(self.seed * 1000 + level_index)
        out = []
        for _ in range(self.requests):
            n = rng.randint(self.prompt_min, self.prompt_max)
            out.append([rng.randrange(FIRST_ID, id_limit) for _ in range(n)])
        return out


@dataclass(frozen=True, slots=True)
class Outcome:
    ttft_s: float
    latency_s: float
    output_tokens: int
    error: str | None


@dataclass(frozen=True, slots=True)
class LevelResult:
    engine: str
    concurrency: int
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    wall_s: float
    output_tokens: int
    errors: int
    load_before: float
    load_after: float

    def line(self) -> str:
        return (
            f"  {self.engine:<16} conc={self.concurrency:<3} out_tok_s={self.tok_s:9.1f} "
            f"ttft_p50_ms={self.ttft_p50_ms:9.1f} ttft_p99_ms={self.ttft_p99_ms:9.1f} "
            f"wall_s={self.wall_s:7.1f} tokens={self.output_tokens} errors={self.errors} "
            f"load1={self.load_before:.1f}->{self.load_after:.1f}"
        )


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """SSE lines, split on newlines only: httpx's aiter_lines also splits on U+2028 and
    other Unicode separators, which random-weight token text carries inside JSON strings."""
    buf = ""
    async for chunk in resp.aiter_text():
        buf += chunk
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buf:
        yield buf


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    logprobs: bool,
) -> Outcome:
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if logprobs:
        body["logprobs"] = 1
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return Outcome(0.0, 0.0, 0, f"HTTP {resp.status_code}: {text[:200]}")
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return Outcome(0.0, 0.0, 0, f"stream error: {data[:200]}")
                if first is None and event.get("choices"):
                    first = time.perf_counter()
                usage = event.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens", 0))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return Outcome(0.0, 0.0, 0, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if tokens == 0:
        return Outcome(0.0, 0.0, 0, "no usage.completion_tokens in the stream")
    return Outcome((first or end) - start, end - start, tokens, None)


async def run_level(
    url: str,
    model: str,
    prompts: list[list[int]] | list[str],
    concurrency: int,
    max_tokens: int,
    logprobs: bool,
    headers: dict[str, str] | None = None,
) -> tuple[list[Outcome], float]:
    queue: asyncio.Queue[list[int] | str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(3600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:

        async def worker() -> None:
            while True:
                try:
                    prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                outcomes.append(await one_request(client, url, model, prompt, max_tokens, logprobs))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return outcomes, wall


@dataclass(frozen=True, slots=True)
class Serving:
    """A running engine as the bench drives it: its URL, and how it takes the workload."""

    url: str
    pid: int
    model: str
    ready_s: float
    cmd: list[str]
    headers: dict[str, str] | None = None
    tokenizer: Tokenizer | None = None  # set: prompts go as text (a text-only router)

    @classmethod
    def of(cls, server: PeerServer) -> Serving:
        model = served_model(server.url)
        return cls(server.url, server.pid, model, server.ready_s or 0.0, server.cmd)

    def render(self, prompts: list[list[int]]) -> list[list[int]] | list[str]:
        tok = self.tokenizer
        return prompts if tok is None else [as_text(tok, ids) for ids in prompts]


def as_text(tok: Tokenizer, ids: list[int]) -> str:
    """Text that encodes to at most len(ids) tokens, as close as a few rounds get."""
    n, cur = len(ids), ids
    text = tok.decode(cur)
    for _ in range(8):
        again = tok.encode(text)
        if len(again) == n:
            return text
        cur = again[:n] if len(again) > n else again + cur[len(again) : n]
        text = tok.decode(cur)
    while len(tok.encode(text)) > n:
        text = text[:-1]
    return text


def measure(
    engine: str,
    server: Serving,
    work: Workload,
    id_limit: int,
    log: Callable[[str], None],
    profile: Path | None = None,
) -> list[LevelResult]:
    model = server.model
    # Warm-up (not counted): first-call allocations, lazy compilation, thread pools.
    warm = server.render([list(range(FIRST_ID, FIRST_ID + 32))])
    outs, _ = asyncio.run(
        run_level(server.url, model, warm * 2, 2, 8, work.logprobs, server.headers)
    )
    for o in outs:
        if o.error:
            raise RuntimeError(f"{engine}: warm-up request failed: {o.error}")
    results = []
    for i, conc in enumerate(work.levels):
        prompts = server.render(work.prompts(i, id_limit))
        if server.tokenizer is not None:
            sent = sum(len(server.tokenizer.encode(str(p))) for p in prompts)
            ids = sum(len(p) for p in work.prompts(i, id_limit))
            log(f"  {engine} conc={conc}: prompt tokens sent as text {sent} (as ids {ids})")
        load_before = os.getloadavg()[0]
        spy = profiler(server.pid, profile) if profile and conc == max(work.levels) else None
        outs, wall = asyncio.run(
            run_level(
                server.url, model, prompts, conc, work.output_tokens, work.logprobs, server.headers
            )
        )
        if spy is not None:
            stop_profiler(spy, log)
        ok = [o for o in outs if o.error is None]
        errors = [o.error for o in outs if o.error is not None]
        if errors:
            log(f"  {engine} conc={conc}: {len(errors)} failed requests, first: {errors[0]}")
        ttft = [o.ttft_s * 1000 for o in ok]
        tokens = sum(o.output_tokens for o in ok)
        result = LevelResult(
            engine=engine,
            concurrency=conc,
            tok_s=tokens / wall if wall > 0 else 0.0,
            ttft_p50_ms=percentile(ttft, 50),
            ttft_p99_ms=percentile(ttft, 99),
            wall_s=wall,
            output_tokens=tokens,
            errors=len(errors),
            load_before=load_before,
            load_after=os.getloadavg()[0],
        )
        log(result.line())
        results.append(result)
    return results


def profiler(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """`py-spy record` attached to `pid` (its own session); folded stacks go to `out`."""
    py_spy = Path(sys.executable).parent / "py-spy"
    cmd = [str(py_spy), "record", "--pid", str(pid), "--format", "raw", "-o", str(out)]
    cmd += ["--rate", "50", "--nonblocking"]
    spy = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    time.sleep(1.0)  # attached before the first request goes out
    return spy


def stop_profiler(spy: subprocess.Popen[bytes], log: Callable[[str], None]) -> None:
    """SIGINT makes py-spy write its file and exit."""
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()
        log("  py-spy did not stop on SIGINT; killed (profile may be missing)")


def served_model(url: str) -> str:
    resp = httpx.get(url + "/v1/models", timeout=30.0)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def start_kvfence(
    model_dir: Path, log_dir: Path, *extra: str, context: int = CONTEXT
) -> PeerServer:
    """`kvfence serve` as a subprocess in its own session, like the peers."""
    port = free_port()
    kvfence_bin = Path(sys.executable).parent / "kvfence"
    cmd = [
        str(kvfence_bin),
        "serve",
        "--model",
        str(model_dir),
        "--model-kind",
        "llama",
        "--no-auth",
        "--port",
        str(port),
        "--kv-bytes",
        str(KV_BYTES),
        "--context-length",
        str(context),
        *extra,
    ]
    return launch_server("kvfence", cmd, dict(os.environ), port, model_dir.name, "/health", log_dir)


@contextmanager
def pd_stack(
    transport: str,
    model_dir: Path,
    log_dir: Path,
    edge: bool = True,
    context: int = CONTEXT,
    share_cores: bool = True,
) -> Iterator[Serving]:
    """sglang-router + one prefill + one decode kvfence worker (sglang_stack/stack.py)."""
    from kvfence.serve.tenants import TenantRegistry
    from kvfence.sglang_stack.stack import Stack, StackSpec

    # One tenant carries the whole load here: the per-tenant defaults, there to keep one
    # tenant from starving the others, would refuse it (the single process runs --no-auth).
    tenants = TenantRegistry.generate(("bench",)).without_default_limits()
    workdir = Path(tempfile.mkdtemp(prefix="kvfence-pd-", dir=log_dir))
    tenants_file = workdir / "tenants.json"
    tenants_file.write_text(tenants.to_json())
    args = ["--model", str(model_dir), "--model-kind", "llama", "--kv-bytes", str(KV_BYTES)]
    args += ["--context-length", str(context), "--torch-threads", "1", "--transport", transport]
    t0 = time.perf_counter()
    spec = StackSpec(tuple(args), tenants_file, edge=edge, share_cores=share_cores)
    with Stack(spec, workdir=workdir) as stack:
        ready = time.perf_counter() - t0
        key = {"Authorization": f"Bearer {tenants.tenants[0].keys[0]}"}
        router = stack.supervisor.procs["sglang-router"]
        argv = [f"sglang-router PD + kvfence workers ({transport}), logs {workdir}"]
        tok = Tokenizer.from_dir(model_dir)
        yield Serving(stack.url, router.pid, model_dir.name, ready, argv, key, tok)


def vllm_blocks(model_dir: Path) -> int:
    """vLLM KV blocks (128 tokens, float32) in KV_BYTES for this checkpoint, plus its null
    block."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4
    return KV_BYTES // (VLLM_BLOCK * per_token) + 1


@contextmanager
def vllm_pd(model_dir: Path, log_dir: Path) -> Iterator[Serving]:
    from bench.peers.pd_fleet import start_vllm_pd

    fleet = start_vllm_pd(
        model_dir, blocks=vllm_blocks(model_dir), max_model_len=CONTEXT, log_dir=log_dir
    )
    with fleet:
        ready = max(s.ready_s or 0.0 for s in fleet.servers)
        argv = [f"vllm-router PD + vLLM prefill/decode (NIXL), logs {log_dir}"]
        tok = Tokenizer.from_dir(model_dir)
        yield Serving(fleet.url, fleet.router.pid, fleet.model, ready, argv, None, tok)


@contextmanager
def engine_server(
    engine: str, model_dir: Path, log_dir: Path, kvfence_args: tuple[str, ...] = ()
) -> Iterator[Serving]:
    if engine in PD_TRANSPORTS:
        log_dir.mkdir(parents=True, exist_ok=True)
        edge = engine != "kvfence-pd-noedge"
        share = engine != "kvfence-pd-split"
        with pd_stack(
            PD_TRANSPORTS[engine], model_dir, log_dir, edge, share_cores=share
        ) as serving:
            yield serving
        return
    if engine == "vllm-pd":
        log_dir.mkdir(parents=True, exist_ok=True)
        with vllm_pd(model_dir, log_dir) as serving:
            yield serving
        return
    if engine == "kvfence":
        server = start_kvfence(model_dir, log_dir, *kvfence_args)
    elif engine == "kvfence-noledger":
        server = start_kvfence(model_dir, log_dir, "--lab-fault", "no-ledger-check", *kvfence_args)
    elif engine == "kvfence-fcfs":
        server = start_kvfence(model_dir, log_dir, "--prefill-order", "arrival", *kvfence_args)
    elif engine == "vllm":
        server = start_vllm(
            model_dir,
            dtype="float32",
            omp_threads_bind="0-1",
            kv_cache_gib=KV_BYTES / (1 << 30),
            max_model_len=CONTEXT,
            enable_prompt_tokens_details=False,
        )
    else:
        server = start_llamacpp(
            model_dir, ctx_size=LLAMA_CTX, parallel=LLAMA_SLOTS, threads=2, outtype="f32"
        )
    with server:
        yield Serving.of(server)


def installed(engine: str, cache: PeerCache) -> bool:
    if engine == "vllm":
        return cache.vllm_installed()
    if engine == "vllm-pd":
        return cache.vllm_installed() and cache.nixl_installed()
    if engine == "llamacpp":
        return cache.llamacpp_installed()
    if engine in PD_TRANSPORTS:
        # Mooncake and NIXL load their native engines in the workers; ask here first.
        from kvfence.transfer.native import missing_native

        return missing_native(PD_TRANSPORTS[engine]) is None
    return True


def ratio(a: float, b: float | None) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm")
    ap.add_argument("--requests", type=int, default=None, help="per level [64; --quick 16]")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--levels", default="1,4,16", help="concurrency levels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick", action="store_true", help="16 requests, 32-128-token prompts, 16 output tokens"
    )
    ap.add_argument(
        "--profile-kvfence",
        type=Path,
        default=None,
        help="py-spy kvfence during the highest concurrency level; folded stacks go here",
    )
    ap.add_argument(
        "--no-logprobs",
        action="store_true",
        help="do not ask for logprobs=1 (then TTFT is wrong where no token has text)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes over every engine, one after another; the result lines give medians",
    )
    ap.add_argument(
        "--kvfence-arg",
        action="append",
        default=[],
        help="an extra `kvfence serve` argument for every single-process kvfence (repeatable), "
        "e.g. --kvfence-arg=--max-batch-tokens=1024",
    )
    args = ap.parse_args()
    kvfence_args = tuple(args.kvfence_arg)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES + EXTRA_ENGINES)
    if unknown:
        ap.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES + EXTRA_ENGINES}")
    quick, full = (args.requests or 16, 32, 128, 16), (args.requests or 64, 64, 512, 64)
    sizes = quick if args.quick else full
    levels = tuple(int(c) for c in args.levels.split(","))
    work = Workload(*sizes, levels, args.seed, not args.no_logprobs)

    def log(msg: str) -> None:
        print(msg, flush=True)

    cache = PeerCache.from_env()
    model_dir = default_checkpoint_dir(preset=args.preset)
    id_limit = PRESETS[args.preset].tokenizer_size
    log(
        f"serve_throughput: preset={args.preset} checkpoint={model_dir} requests={work.requests} "
        f"prompts={work.prompt_min}-{work.prompt_max} output={work.output_tokens} "
        f"levels={work.levels} seed={work.seed} logprobs={work.logprobs} cores={os.cpu_count()} "
        f"load1={os.getloadavg()[0]:.1f}"
    )
    runs: dict[str, dict[int, list[LevelResult]]] = {}
    for rep in range(args.repeats):
        # Passes one after another, every engine once per pass: a slow spell of the shared
        # machine then lands on one pass of every engine, not on all passes of one.
        for engine in engines:
            if not installed(engine, cache):
                if rep == 0:
                    log(
                        f"{engine}: SKIPPED, not installed in {cache.root} (bench/peers/install.sh)"
                    )
                continue
            profile = args.profile_kvfence if engine == "kvfence" and rep == 0 else None
            t0 = time.perf_counter()
            with engine_server(engine, model_dir, cache.run_dir / "logs", kvfence_args) as server:
                log(f"{engine}: ready in {server.ready_s:.1f} s ({' '.join(server.cmd[:3])} ...)")
                results = measure(engine, server, work, id_limit, log, profile)
            for r in results:
                runs.setdefault(engine, {}).setdefault(r.concurrency, []).append(r)
            log(f"{engine}: pass {rep + 1}/{args.repeats} done in {time.perf_counter() - t0:.0f} s")

    for conc in work.levels:
        per = {e: r[conc] for e, r in runs.items()}
        figures = {e: statistics.median(x.tok_s for x in rs) for e, rs in per.items()}
        ttft = {e: statistics.median(x.ttft_p50_ms for x in rs) for e, rs in per.items()}
        kv = figures.get("kvfence")
        parts = [f"{e}={v:.1f}" for e, v in figures.items()]
        if kv is not None:
            parts.append(f"kvfence/vllm={ratio(kv, figures.get('vllm'))}")
            parts.append(f"kvfence/llamacpp={ratio(kv, figures.get('llamacpp'))}")
            for pd in PD_TRANSPORTS:
                if pd in figures and "vllm-pd" in figures:
                    parts.append(f"{pd}/vllm-pd={ratio(figures[pd], figures['vllm-pd'])}")
            parts.append(f"isolation_cost=1-{ratio(kv, figures.get('kvfence-noledger'))}")
            if "kvfence-fcfs" in figures:
                parts.append(f"kvfence/kvfence-fcfs={ratio(kv, figures['kvfence-fcfs'])}")
            for pd in PD_TRANSPORTS:
                if pd in figures:
                    parts.append(f"{pd}/kvfence={ratio(figures[pd], kv)}")
        parts.append("ttft_p50_ms: " + " ".join(f"{e}={v:.0f}" for e, v in ttft.items()))
        loads = "/".join(f"{x.load_before:.1f}" for rs in per.values() for x in rs)
        median = f"median of {args.repeats} " if args.repeats > 1 else ""
        log(
            f"serve_throughput preset={args.preset} conc={conc} {median}out_tok_s: "
            + " ".join(parts)
            + f" (load1 {loads})"
        )
    if args.profile_kvfence is not None:
        log(f"kvfence py-spy profile (folded stacks): {args.profile_kvfence}")


if __name__ == "__main__":
    main()
