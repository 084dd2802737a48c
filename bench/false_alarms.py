"""False alarms: repeated audits at the default alpha on targets that do not leak.

Two isolating targets, each audited `--repeats` times (seeds 0..N-1, so every run's prompts
are its own and the whole bench is reproducible):

(a) the hardened kvfence engine (`kvfence serve`, the demo's real-transformer body
    `--model-kind mirror-body --preset demo`, context 512, 64 pages, every defence on):
    the full runbook through the real CLI, `kvfence audit --target URL --seed S --json F`
    at the default family-wise alpha (1e-3, split over the statistical checks);
(b) a salted vLLM (the real vLLM CPU peer, prefix caching on, `cached_tokens` reported):
    the prefix-sharing check's salted run alone (`PrefixSharingConfig(salt="only")`:
    tenants A and B send different `cache_salt`s; the same-salt control must hit), at the
    check's default design alpha 1e-3 — vLLM's unsalted cache really is shared across
    tenants, so its unsalted run is a true alarm (bench/vllm_alpha.py), not a false one.

A false alarm is any FAIL. Prints one line per audit (verdicts, p-values, requests, load
average), then per target: FAILs out of runs, every statistical check's p-value
distribution (min / quartiles / max) and the verdict counts.

Usage: python bench/false_alarms.py [--repeats 20] [--skip-vllm] [--skip-kvfence]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers import PeerServer, free_port, launch_server, start_vllm  # noqa: E402

KVFENCE = str(Path(sys.executable).parent / "kvfence")
KEYS = {"a": "sk-bench-false-alarm-a-0123", "b": "sk-bench-false-alarm-b-0123"}
OPERATOR = "sk-bench-false-alarm-operator"
HARDENED = ("--model-kind", "mirror-body", "--preset", "demo", "--context-length", "512")
HARDENED += ("--kv-pages", "64")

Tally = dict[str, list]


def start_kvfence(tmp: Path) -> PeerServer:
    tenants = tmp / "tenants.json"
    entries = [{"name": n, "keys": [k]} for n, k in KEYS.items()]
    tenants.write_text(json.dumps({"tenants": entries, "operator_keys": [OPERATOR]}))
    port = free_port()
    cmd = [KVFENCE, "serve", "--port", str(port), "--tenants", str(tenants), *HARDENED]
    return launch_server("kvfence", cmd, dict(os.environ), port, "demo", "/health", tmp)


def kvfence_audit(url: str, seed: int, out: Path) -> tuple[list[dict], int, float]:
    cmd = [KVFENCE, "audit", "--target", url, "--key-a", KEYS["a"], "--key-b", KEYS["b"]]
    cmd += ["--operator-key", OPERATOR, "--seed", str(seed), "--json", str(out), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if not out.exists():
        raise RuntimeError(f"audit wrote no report (exit {proc.returncode}): {proc.stderr[-800:]}")
    return json.loads(out.read_text())["results"], proc.returncode, wall


def vllm_salted(url: str, seed: int) -> tuple[list[dict], int, float]:
    from kvfence.audit.base import Budget
    from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig
    from kvfence.audit.contract import AuditContext, run_check
    from kvfence.audit.targets.registry import detect

    ctx = AuditContext(seed=seed, budget=Budget(max_requests=5000, max_seconds=900))
    t0 = time.perf_counter()
    with ctx.open():
        target = detect(url, ctx.client_for_url(url, "a"))
        r = run_check(PrefixSharingCheck(PrefixSharingConfig(salt="only")), ctx, target)
    row = {"check": "prefix_sharing[salted]", "verdict": r.verdict.value, "p_value": r.p_value}
    row |= {"alpha": r.alpha, "requests_sent": r.requests_sent, "summary": r.summary}
    return [row], 1 if r.verdict.value == "fail" else 0, time.perf_counter() - t0


def record(tally: Tally, name: str, seed: int, rows: list[dict], code: int, wall: float) -> None:
    for r in rows:
        tally["verdicts"].append((r["check"], r["verdict"]))
        if r.get("p_value") is not None:
            tally[f"p {r['check']}"].append(float(r["p_value"]))
    brief = " ".join(
        f"{r['check']}={r['verdict']}"
        + (f"(p={r['p_value']:.2g},alpha={r['alpha']:.2g})" if r.get("p_value") is not None else "")
        for r in rows
    )
    fails = [r for r in rows if r["verdict"] == "fail"]
    requests = sum(int(r.get("requests_sent") or 0) for r in rows)
    print(
        f"  {name} seed={seed}: exit={code} {brief} requests={requests} wall_s={wall:.1f} "
        f"load1={os.getloadavg()[0]:.1f}"
        + "".join(f"\n    FAIL {r['check']}: {r.get('summary', '')[:200]}" for r in fails),
        flush=True,
    )


def summary(name: str, tally: Tally, runs: int) -> None:
    verdicts = Counter(v for _, v in tally["verdicts"])
    fail_runs = sum(v == "fail" for _, v in tally["verdicts"])
    print(f"{name}: {fail_runs} FAIL verdict(s) in {runs} audits; verdicts {dict(verdicts)}")
    for key in sorted(k for k in tally if k.startswith("p ")):
        ps = sorted(tally[key])
        q = statistics.quantiles(ps, n=4) if len(ps) > 1 else [ps[0]] * 3
        print(
            f"  {key[2:]} p-values (n={len(ps)}): min={ps[0]:.3g} q25={q[0]:.3g} "
            f"median={q[1]:.3g} q75={q[2]:.3g} max={ps[-1]:.3g}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-kvfence", action="store_true")
    args = ap.parse_args()
    print(f"false_alarms: cores={os.cpu_count()} repeats={args.repeats} "
          f"load1={os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvfence-false-alarms-") as tmp_s:
        tmp = Path(tmp_s)
        tallies: dict[str, Tally] = {}
        if not args.skip_kvfence:
            tally = tallies["kvfence hardened (full audit)"] = defaultdict(list)
            with start_kvfence(tmp) as srv:
                for seed in range(args.repeats):
                    rows, code, wall = kvfence_audit(srv.url, seed, tmp / f"k{seed}.json")
                    record(tally, "kvfence hardened", seed, rows, code, wall)
        if not args.skip_vllm:
            from kvfence.model.tiny import make_tiny_checkpoint

            tally = tallies["vLLM salted (prefix sharing, salted run)"] = defaultdict(list)
            ckpt = make_tiny_checkpoint(tmp / "tiny", seed=0)
            with start_vllm(ckpt, enforce_eager=True, log_dir=tmp) as vllm:
                for seed in range(args.repeats):
                    record(tally, "vLLM salted", seed, *vllm_salted(vllm.url, seed))
        for name, tally in tallies.items():
            summary(name, tally, args.repeats)
        print(f"load1={os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
