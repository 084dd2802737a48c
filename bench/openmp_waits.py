"""How `kvfence serve`'s OpenMP threads wait: PASSIVE vs brief spin vs libgomp's default, same run.

The decode kernels run on their own threads (model/csrc/spin_pool.h); libgomp's
wait setting now governs torch's own ops (prefill's matrix products, sampling).
libgomp reads it once, when torch loads it, so each setting is a server of its
own: `kvfence serve --model DIR` (the smollm preset: SmolLM2-135M's geometry,
f32, all cores) started with

  passive   OMP_WAIT_POLICY=PASSIVE: what `kvfence serve` sets unless the user chose
  spin10k   GOMP_SPINCOUNT=10000: about 0.1 ms of spinning
  spin2k    GOMP_SPINCOUNT=2000
  spin300k  GOMP_SPINCOUNT=300000: libgomp's own default (about 3 ms of spinning)

and, with `--busy N`, N busy-looping processes beside it (the machine shared with
other work). Per server: the decode cost, from two non-streamed requests on the
same seeded 64-token prompt, one with `max_tokens` 201 and one with 1
((t201 - t1) / 200 ms a token, prefill and HTTP cancel out), and the TTFT of a
256-token prompt (`max_tokens` 1; the better of two prompts). The settings run in turn, `--repeats` times,
for each busy level; medians are compared with `passive` measured in the same
run (ratio > 1: faster than PASSIVE).

  openmp_waits busy=0 spin10k decode_ms=... ttft256_ms=... decode_vs_passive=... load1=...

Usage: python bench/openmp_waits.py [--busy 0,2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers import free_port, launch_server  # noqa: E402

from kvfence.model.tiny import default_checkpoint_dir  # noqa: E402

SETTINGS = {
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin2k": {"GOMP_SPINCOUNT": "2000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin300k": {"GOMP_SPINCOUNT": "300000"},
}
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def load1() -> str:
    return f"{os.getloadavg()[0]:.1f}"


@contextmanager
def busy(n: int) -> Iterator[None]:
    """`n` processes that spin on the CPU until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def complete(client: httpx.Client, model: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={**body, "ignore_eos": True})
    r.raise_for_status()
    if r.json()["usage"]["completion_tokens"] != max_tokens:
        raise RuntimeError(f"expected {max_tokens} tokens: {r.text[:200]}")
    return time.perf_counter() - t0


def measure(setting: str, model_dir: Path, log_dir: Path, seed: int) -> tuple[float, float]:
    """(decode ms a token, TTFT ms of a 256-token prompt) of one server under `setting`."""
    port = free_port()
    kvfence = Path(sys.executable).parent / "kvfence"
    cmd = [str(kvfence), "serve", "--model", str(model_dir), "--model-kind", "llama"]
    cmd += ["--no-auth", "--port", str(port), "--kv-bytes", str(1 << 30)]
    cmd += ["--context-length", "4096"]
    env = {k: v for k, v in os.environ.items() if k not in WAIT_KEYS} | SETTINGS[setting]
    server = launch_server("kvfence", cmd, env, port, model_dir.name, "/health", log_dir)
    rng = random.Random(seed)
    short = [rng.randrange(100, 40000) for _ in range(64)]
    longs = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(2)]
    try:
        with httpx.Client(base_url=server.url, timeout=300.0) as client:
            complete(client, server.model, short, 1)  # warm-up
            one = complete(client, server.model, short, 1)
            many = complete(client, server.model, short, 201)
            ttft = min(complete(client, server.model, p, 1) for p in longs)  # no cache hit
    finally:
        server.stop()
    return (many - one) / 200 * 1000, ttft * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", default="0,2", help="busy processes beside the server")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model_dir = default_checkpoint_dir(preset="smollm")
    log_dir = Path(tempfile.mkdtemp(prefix="kvfence-omp-"))
    print(f"openmp_waits: checkpoint={model_dir} cores={os.cpu_count()} load1={load1()}")
    for n in (int(x) for x in args.busy.split(",")):
        runs: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
        with busy(n):
            for rep in range(args.repeats):
                for setting in SETTINGS:
                    runs[setting].append(measure(setting, model_dir, log_dir, args.seed + rep))
                    d, t = runs[setting][-1]
                    print(f"# busy={n} {setting} decode_ms={d:.1f} ttft256_ms={t:.0f} "
                          f"load1={load1()}", flush=True)  # fmt: skip
        report(n, runs, args.repeats)


def report(n: int, runs: dict[str, list[tuple[float, float]]], repeats: int) -> None:
    med = {s: (statistics.median(d for d, _ in r), statistics.median(t for _, t in r))
           for s, r in runs.items()}  # fmt: skip
    base_d, base_t = med["passive"]
    for s, (d, t) in med.items():
        print(
            f"openmp_waits busy={n} {s} decode_ms={d:.1f} ttft256_ms={t:.0f} "
            f"decode_vs_passive={base_d / d:.2f} ttft_vs_passive={base_t / t:.2f} "
            f"repeats={repeats} load1={load1()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
