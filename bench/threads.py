"""Thread settings on this machine: intra-op, inter-op threads and OpenMP's wait policy, interleaved.

Seeded. Each configuration runs in its own interpreter (inter-op threads can
be set only before torch's first parallel work): `torch.set_num_threads(T)`,
`torch.set_num_interop_threads(I)` and `OMP_WAIT_POLICY` (unset: libgomp's
default, whose idle threads spin after every parallel region; PASSIVE: they
sleep), then the in-process pipeline on a
seeded random-weight checkpoint (`--preset`, default smollm: SmolLM2-135M's
geometry, f32) serves `--rows` requests of 128-token prompts and 16 greedy
output tokens each, all submitted at once (prefill and decode steps both
count). The configurations run in turn, `--repeats` times; the medians are
compared with torch's default on this machine (intra = inter = the cores),
measured in the same run.

Prints one line per configuration and the load average:

  threads intra=2 interop=1 omp_wait=PASSIVE wall_s=... tok_s=... ratio_vs_default=... load1=...

`--served` compares only what `kvfence serve --torch-threads` chooses between:
all cores vs one intra-op thread, both under the CLI's OMP_WAIT_POLICY=PASSIVE.

Usage: python bench/threads.py [--preset smollm] [--rows 8] [--repeats 3] [--served]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = """
import sys, tempfile, time, torch
intra, interop, preset, rows = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.set_num_threads(intra)
torch.set_num_interop_threads(interop)
from kvfence.engine.backend import GenerateWork
from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import SamplingParams
from kvfence.serve.pipeline import CollectingSink, LocalPipeline
from kvfence.model.loader import load_model
from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.transfer.link import inprocess_link
torch.manual_seed(0)
with tempfile.TemporaryDirectory() as d:
    make_tiny_checkpoint(d, preset=preset)
    loaded = load_model(d, kind="llama")
pages = 10 * rows
config = EngineConfig(prefill_pages=pages, decode_pages=pages, page_size=16, max_running=rows)
geometry = loaded.config.kv_geometry(page_size=16)
pipe = LocalPipeline(loaded.model, geometry, config, kv_link=inprocess_link)
g = torch.Generator().manual_seed(1)
vocab = loaded.config.vocab_size
sinks = []
start = time.perf_counter()
for i in range(rows):
    prompt = tuple(torch.randint(3, vocab, (128,), generator=g).tolist())
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    sinks.append(CollectingSink())
    pipe.submit(GenerateWork(f"r{i}", f"t{i % 4}", prompt, sampling, f"t{i % 4}"), sinks[-1])
pipe.drive()
wall = time.perf_counter() - start
pipe.check_integrity()
print("RESULT", wall, rows * 16)
"""


def load1() -> str:
    return f"{os.getloadavg()[0]:.1f}"


Config = tuple[int, int, str]  # intra, interop, OMP_WAIT_POLICY ("" = unset)


def run(config: Config, preset: str, rows: int) -> tuple[float, int]:
    intra, interop, policy = config
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(intra), str(interop), preset, str(rows)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT"))
    _, wall, tokens = line.split()
    return float(wall), int(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--served",
        action="store_true",
        help="only what `kvfence serve` can choose: OMP_WAIT_POLICY=PASSIVE (its default) "
        "with all cores vs 1 intra-op thread (the default is then all cores, PASSIVE)",
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    default: Config = (cores, 1, "PASSIVE") if args.served else (cores, cores, "")
    configs: list[Config] = (
        [default, (1, 1, "PASSIVE")]
        if args.served
        else [default, (cores, 1, ""), (cores, 1, "PASSIVE"), (1, 1, "")]
    )
    walls: dict[Config, list[float]] = {c: [] for c in configs}
    tokens = 0
    for _ in range(args.repeats):
        for c in configs:
            wall, tokens = run(c, args.preset, args.rows)
            walls[c].append(wall)
            print(f"# {label(c)} wall_s={wall:.2f} load1={load1()}", flush=True)
    base = statistics.median(walls[default])
    for c in configs:
        wall = statistics.median(walls[c])
        print(
            f"threads {label(c)} wall_s={wall:.2f} tok_s={tokens / wall:.1f} "
            f"ratio_vs_default={base / wall:.2f} preset={args.preset} rows={args.rows} "
            f"repeats={args.repeats} load1={load1()}",
            flush=True,
        )


def label(c: Config) -> str:
    return f"intra={c[0]} interop={c[1]} omp_wait={c[2] or 'unset'}"


if __name__ == "__main__":
    main()
