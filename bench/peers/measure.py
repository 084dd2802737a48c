"""Time the peer kit and print what each peer reports for the tiny checkpoint.

    .venv/bin/python bench/peers/measure.py [--skip-vllm]

Runs install.sh (warm: seconds), starts each peer once on the seeded tiny checkpoint with
the test suite's small pools, and prints its ready time and pool facts, then one result line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers import (  # noqa: E402
    convert_to_gguf,
    ensure_installed,
    http_get,
    llamacpp_n_ctx,
    start_llamacpp,
    start_vllm,
    vllm_pool_tokens,
)

from kvfence.model.tiny import make_tiny_checkpoint  # noqa: E402


def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _cache_config(url: str) -> str:
    """The pool labels of vllm:cache_config_info (num_gpu_blocks is the CPU pool on CPU)."""
    _, body = http_get(url + "/metrics")
    lines = [ln for ln in body.decode().splitlines() if ln.startswith("vllm:cache_config_info")]
    if not lines:
        return "(no vllm:cache_config_info)"
    keys = ("num_gpu_blocks", "block_size", "kv_cache_size_tokens", "kv_cache_memory_bytes")
    found = dict(re.findall(r'(\w+)="([^"]*)"', lines[0]))
    return " ".join(f"{k}={found.get(k)}" for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--default-pool", action="store_true", help="also start vLLM with its own 1 GiB sizing"
    )
    args = ap.parse_args()

    t0 = time.monotonic()
    ensure_installed()
    install_s = time.monotonic() - t0
    results = [f"install_warm_s={install_s:.1f}"]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "tiny", seed=args.seed)
        t0 = time.monotonic()
        convert_to_gguf(ckpt)
        results.append(f"gguf_convert_s={time.monotonic() - t0:.1f}")
        t0 = time.monotonic()
        convert_to_gguf(ckpt)
        results.append(f"gguf_cached_s={time.monotonic() - t0:.2f}")

        with start_llamacpp(ckpt, ctx_size=4096, parallel=2, threads=2) as lc:
            props = _json(lc.url + "/props")
            n_ctx = props["default_generation_settings"]["n_ctx"]
            print(
                f"llama.cpp ready in {lc.ready_s:.1f} s; /props n_ctx={n_ctx} "
                f"total_slots={props['total_slots']}; log n_ctx={llamacpp_n_ctx(lc.log_text())}"
            )
            results.append(f"llamacpp_ready_s={lc.ready_s:.1f}")

        if not args.skip_vllm:
            with start_vllm(ckpt, num_gpu_blocks_override=64, max_model_len=2048) as vl:
                models = _json(vl.url + "/v1/models")
                print(
                    f"vLLM ready in {vl.ready_s:.1f} s; max_model_len="
                    f"{models['data'][0]['max_model_len']}; log pool="
                    f"{vllm_pool_tokens(vl.log_text())} tokens; {_cache_config(vl.url)}"
                )
                results.append(f"vllm_ready_s={vl.ready_s:.1f}")
        if not args.skip_vllm and args.default_pool:
            with start_vllm(ckpt) as vl:
                print(
                    f"vLLM (default 1 GiB pool) ready in {vl.ready_s:.1f} s; log pool="
                    f"{vllm_pool_tokens(vl.log_text())} tokens; {_cache_config(vl.url)}"
                )
    print("peers: " + " ".join(results))


if __name__ == "__main__":
    main()
