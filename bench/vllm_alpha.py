"""`kvfence audit --alpha 1e-9` against a real vLLM (prefix caching on, no salt): how many
requests the prefix-sharing check needs to fail it at that level (Gu et al. used 250 + 250).

Starts the real vLLM CPU peer (bench/peers, `make peers`) on the project's seeded tiny
checkpoint with its defaults (prefix caching on; `cache_salt` accepted but not sent by the
unsalted run), then runs the real CLI: `kvfence audit --target URL --checks prefix_sharing
--alpha A --json FILE --seed S`. By default vLLM does not report
`usage.prompt_tokens_details.cached_tokens`, so the verdict rests on timing alone (the
one-sided sequential KS test); `--details` turns those reports on (then a cross-tenant
`cached_tokens` hit can end the run early).

`--max-per-arm N` also runs the unsalted test alone in-process with a sequential budget of N
trials per arm (it stops at the first look that rejects): how many requests a decisive
verdict at that alpha takes when the budget is not the limit.

Prints one line per run (verdict, p-value, alpha, requests, seconds, load average) and the
unsalted and salted runs' requests from the evidence.

Usage: python bench/vllm_alpha.py [--alpha 1e-9] [--seeds 0] [--details] [--max-per-arm N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers import start_vllm  # noqa: E402

from kvfence.model.tiny import make_tiny_checkpoint  # noqa: E402

KVFENCE = str(Path(sys.executable).parent / "kvfence")


def audit(url: str, alpha: float, seed: int, out: Path, checks: str) -> tuple[int, dict, float]:
    """Run the real CLI once; (exit code, JSON report, wall seconds)."""
    cmd = [KVFENCE, "audit", "--target", url, "--checks", checks, "--alpha", f"{alpha:g}"]
    cmd += ["--seed", str(seed), "--json", str(out), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if not out.exists():
        raise RuntimeError(f"audit wrote no report (exit {proc.returncode}): {proc.stderr[-800:]}")
    return proc.returncode, json.loads(out.read_text()), wall


def run_requests(evidence: dict) -> str:
    """Each run (unsalted, salted) of the check: requests, verdict, KS distance, from evidence."""
    parts = [f"prefix={evidence.get('prefix_tokens', '?')} tokens"]
    for label in ("unsalted", "salted"):
        run = evidence.get(label)
        if isinstance(run, dict):
            ks = run.get("ks") or {}
            parts.append(
                f"{label}={run.get('requests', '?')}({run.get('verdict', '?')}, "
                f"KS D={_g(ks.get('statistic'))} p={_g(ks.get('p_value'))}, detectable "
                f"D>={_g(ks.get('detectable_ks_distance'))}, errors={run.get('error_count', 0)}"
                + (f" first={run['errors'][0]}" if run.get("errors") else "")
                + ")"
            )
    return " ".join(parts)


def _g(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def enlarged(url: str, alpha: float, seed: int, max_per_arm: int) -> str:
    """The unsalted run alone at ``alpha`` with a sequential budget of ``max_per_arm`` trials
    (it stops at the first look that rejects): the requests a decisive verdict takes."""
    from kvfence.audit.base import Budget
    from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig
    from kvfence.audit.contract import AuditContext, run_check
    from kvfence.audit.stats import SequentialDesign
    from kvfence.audit.targets.registry import detect

    design = SequentialDesign(alpha=alpha, batch=8, max_per_arm=max_per_arm)
    cfg = PrefixSharingConfig(salt="off", design=design, stop_on_cached_evidence=False)
    ctx = AuditContext(seed=seed, budget=Budget(max_requests=10_000, max_seconds=1800))
    t0 = time.perf_counter()
    with ctx.open():
        target = detect(url, ctx.client_for_url(url, "a"))
        r = run_check(PrefixSharingCheck(cfg), ctx, target)
    return (
        f"unsalted run, design max_per_arm={max_per_arm} batch=8 alpha={alpha:g}: "
        f"{r.verdict.value} p={_g(r.p_value)} requests={r.requests_sent} "
        f"[{run_requests(r.evidence)}] wall_s={time.perf_counter() - t0:.1f} "
        f"load1={os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--alpha", type=float, default=1e-9)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--details", action="store_true", help="vLLM reports cached_tokens")
    ap.add_argument("--checks", default="prefix_sharing")
    ap.add_argument(
        "--max-per-arm",
        type=int,
        default=0,
        help="also run the unsalted test alone with this sequential budget (0: skip)",
    )
    args = ap.parse_args()
    print(f"vllm_alpha: cores={os.cpu_count()} load1={os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvfence-vllm-alpha-") as tmp_s:
        tmp = Path(tmp_s)
        ckpt = make_tiny_checkpoint(tmp / "tiny", seed=0)
        with start_vllm(
            ckpt,
            enable_prompt_tokens_details=args.details,
            enforce_eager=True,
            log_dir=tmp,
        ) as vllm:
            print(f"vLLM ready in {vllm.ready_s:.1f} s at {vllm.url}", flush=True)
            for seed in args.seeds:
                code, report, wall = audit(
                    vllm.url, args.alpha, seed, tmp / f"{seed}.json", args.checks
                )
                for r in report["results"]:
                    print(
                        f"{r['check']} seed={seed}: {r['verdict']} p={r['p_value']} "
                        f"alpha={r['alpha']} requests={r['requests_sent']} "
                        f"[{run_requests(r['evidence'])}] exit={code} wall_s={wall:.1f} "
                        f"cached_tokens_reported={args.details} "
                        f"load1={os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                if args.max_per_arm:
                    print(enlarged(vllm.url, args.alpha, seed, args.max_per_arm), flush=True)


if __name__ == "__main__":
    main()
