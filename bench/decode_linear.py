"""Decode linears: the kernel's paths against torch's linear, cold weights, same run.

Seeded. For every projection of a model geometry (default: SmolLM2-135M's, what
`bench/serve_throughput.py` serves: qkv, o, gate/up and down per layer, and the
tied lm_head) and every `--levels` token count, times, interleaved, one call of
(a) `CPULinear()` (what the engine runs: the kernel's vector path, blocks of weight
rows against a few tokens in registers with the next block prefetched), (b)
`CPULinear(vector=False)` (the kernel's scalar tile, what other shapes run) and
(c) torch's `F.linear` (MKL). Each call reads a fresh copy of the weights
(copies cycled over `--bytes`, so none is in cache: a decode step reads ~540 MB
of weights, far more than L3). Prints per shape and level the microseconds
(minimum of `--repeats` passes), the weight read speed in GB/s and the ratios
scalar / kernel and torch / kernel (> 1: the kernel is faster); then per level the
whole step's linears (30 layers and the head) the same way. Also prints
`torch.sum`'s read speed over the same bytes, the machine's streaming ceiling.

Usage: python bench/decode_linear.py [--levels 1,2,4,8,16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfence.model.linear_cpu import CPULinear

# SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, MLP 1536, 30 layers, vocab 49152.
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
LAYERS = 30


def per_call(fn: Callable[[torch.Tensor, torch.Tensor], object], x, weights) -> float:
    t0 = time.perf_counter()
    for w in weights:
        fn(x, w)
    return (time.perf_counter() - t0) / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bytes", type=float, default=4e8, help="weight copies per shape")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    paths = {"kernel": CPULinear(), "scalar": CPULinear(vector=False), "torch": F.linear}
    big = torch.randn(int(args.bytes // 4))
    best = min(per_call(lambda a, b: a.sum(), big, [big]) for _ in range(3))
    print(f"torch.sum over {args.bytes / 1e6:.0f} MB: {args.bytes / best / 1e9:.1f} GB/s")
    del big
    levels = [int(v) for v in args.levels.split(",")]
    step = {(m, p): 0.0 for m in levels for p in paths}
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(args.bytes // (n * k * 4)))
        weights = [torch.randn(n, k) for _ in range(copies)]
        for m in levels:
            x = torch.randn(m, k)
            want = F.linear(x, weights[0])
            for p in ("kernel", "scalar"):
                assert torch.allclose(paths[p](x, weights[0]), want, atol=1e-3, rtol=1e-4)
            got = {
                p: min(per_call(f, x, weights) for _ in range(args.repeats))
                for p, f in paths.items()
            }
            for p, dt in got.items():
                step[m, p] += dt * (1 if name == "lm_head" else LAYERS)
            print(
                f"{name:8s} {n:5d}x{k:<4d} rows={m:2d} "
                + " ".join(f"{p}={dt * 1e6:7.1f}us" for p, dt in got.items())
                + f" kernel_GBps={n * k * 4 / got['kernel'] / 1e9:5.1f}"
                f" scalar/kernel={got['scalar'] / got['kernel']:.2f}"
                f" torch/kernel={got['torch'] / got['kernel']:.2f}"
                f" load1={os.getloadavg()[0]:.1f}"
            )
        del weights
    for m in levels:
        k, t, f = step[m, "kernel"], step[m, "scalar"], step[m, "torch"]
        print(
            f"decode_linear step rows={m:2d} kernel={k * 1e3:.1f}ms scalar={t * 1e3:.1f}ms "
            f"torch={f * 1e3:.1f}ms scalar/kernel={t / k:.2f} torch/kernel={f / k:.2f}"
        )


if __name__ == "__main__":
    main()
