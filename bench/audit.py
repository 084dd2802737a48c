"""The audit's two costs: the full runbook's wall time, and the requests prefix sharing needs.

Seeded (`--seed`: the audit's RNG, hence every random prompt). Measurements:

(a) The main job: bare `kvfence` (`make demo`), as a user runs it — a fresh
    interpreter, the capacity gate, both embedded servers started together,
    the full runbook on each, reports written, servers stopped together.
    Goal: 30 s on this machine. It must exit 0 (the lab red, the fix green).
    The split, measured in the same run: `startup_s` (both embedded servers
    spawned until both answer /health, timed on their own just before),
    `stop_s`, `runbook_s` and each check's seconds per server (the untimed checks of
    both servers run at once: `untimed_wall`; the timed ones one at a time: `timed_wall`),
    and `other_s` (the interpreter, the gate, the reports: wall − runbook −
    startup − stop).
(b) `PrefixSharingCheck` with `cached_tokens` evidence ignored
    (`stop_on_cached_evidence=False`), no salt, and the sequential design
    `SequentialDesign(alpha=1e-6, batch=8, max_per_arm=64)`: how many
    requests until one-sided KS rejects at the per-look threshold
    (alpha / 8 looks) — against `kvfence serve --lab-fault shared-prefix-cache`,
    against the same server without the switch (baseline: must not reject,
    spends the full budget), and against a real vLLM (prefix caching on by
    default) when the peer kit is installed (`make peers`). The ratio is
    against the paper's 250 + 250 requests (Gu et al., ICML 2025).

Prints one line per measurement:

  main_job_wall_s=... startup_s=... stop_s=... runbook_s=... other_s=... per_check_s=... goal<=30s ratio=... exit=0 load1=...
  prefix_sharing[kvfence shared-prefix-cache] requests=... p=... rejected=... ratio_vs_paper=...
  prefix_sharing[kvfence hardened baseline] requests=... p=... rejected=False ...
  prefix_sharing[vllm default] requests=... p=... rejected=... ratio_vs_paper=...

load1 (the 1-minute load average) is printed on every line: other work on the
machine inflates wall time and TTFT noise alike.

Usage: python bench/audit.py [--seed 0] [--skip-embedded] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.peers import PeerCache, start_vllm  # noqa: E402

from kvfence.audit.base import Budget, CheckResult  # noqa: E402
from kvfence.audit.check_table import TIMED_CHECKS  # noqa: E402
from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig  # noqa: E402
from kvfence.audit.contract import AuditContext, run_check  # noqa: E402
from kvfence.audit.embedded import HARDENED, INCIDENT, started_all, wait_ready  # noqa: E402
from kvfence.audit.stats import SequentialDesign  # noqa: E402
from kvfence.audit.targets.base import Target  # noqa: E402
from kvfence.audit.targets.kvfence import KvfenceTarget  # noqa: E402
from kvfence.audit.targets.vllm import VllmTarget  # noqa: E402

TARGET_S = 30.0
PAPER_REQUESTS = 250 + 250
DESIGN = SequentialDesign(alpha=1e-6, batch=8, max_per_arm=64)
KEY_A = "bench-audit-tenant-a-7d1e"
KEY_B = "bench-audit-tenant-b-3c94"
URL_LINE = re.compile(r"kvfence serving \S+ at (http://\S+)")


def load1() -> str:
    return f"{os.getloadavg()[0]:.1f}"


# -- (a) the embedded default ------------------------------------------------------


def startup_split() -> tuple[float, float]:
    """(seconds until both embedded servers answer /health, seconds to stop both)."""
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-start-") as tmp:
        start = time.perf_counter()
        with started_all((("lab", INCIDENT), ("hardened", HARDENED)), Path(tmp)) as servers:
            for s in servers:
                wait_ready(s)
            ready = time.perf_counter() - start
            stop_from = time.perf_counter()
        return ready, time.perf_counter() - stop_from


def main_job_wall() -> None:
    """The main job (its audit seed is fixed: 0) with the split; see the module docstring."""
    startup, stop = startup_split()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kvfence"], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    found = re.search(r"HTML report: (\S+)", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(
            f"the main job exited {done.returncode} (want 0: demo as expected):\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    report = Path(found.group(1)).with_name("report.json")
    run = json.loads(report.read_text())
    checks = per_target_split(run)
    runbook = run["duration_s"]
    print(
        f"main_job_wall_s={wall:.2f} startup_s={startup:.2f} stop_s={stop:.2f} "
        f"runbook_s={runbook:.2f} other_s={wall - runbook - startup - stop:.2f} "
        f"requests={run['requests_sent']} per_check_s={checks} "
        f"goal<={TARGET_S:.0f}s ratio={wall / TARGET_S:.2f} exit={done.returncode} "
        f"load1={load1()}",
        flush=True,
    )


def per_target_split(run: dict[str, Any]) -> str:
    """`lab[canary:5.1,...] hardened[...] untimed_wall=... timed_wall=...`: each check's seconds
    per server; the untimed checks of both servers run at once (their wall time is the
    slower server's), the timed ones (`TIMED_CHECKS`) one server at a time (their sum)."""
    names = ("lab", "hardened")
    urls = [t["url"] for t in run["targets"]]
    seconds: dict[str, dict[str, float]] = {n: {} for n in names}
    for r in run["results"]:
        seconds[names[urls.index(r["target"])]][r["check"]] = r["duration_s"]
    untimed = max(sum(v for c, v in s.items() if c not in TIMED_CHECKS) for s in seconds.values())
    timed = sum(v for s in seconds.values() for c, v in s.items() if c in TIMED_CHECKS)
    parts = [f"{n}[{','.join(f'{c}:{v:.1f}' for c, v in seconds[n].items())}]" for n in names]
    return " ".join(parts) + f" untimed_wall={untimed:.1f} timed_wall={timed:.1f}"


# -- (b) prefix sharing to p < alpha -------------------------------------------------


@contextmanager
def kvfence_server(tmp: Path, faults: tuple[str, ...]) -> Iterator[str]:
    """`kvfence serve` (its defaults) with two tenants; yields the URL it announces."""
    tenants = tmp / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {"name": "tenant-a", "keys": [KEY_A]},
                    {"name": "tenant-b", "keys": [KEY_B]},
                ]
            }
        )
    )
    cmd = [sys.executable, "-m", "kvfence", "serve", "--tenants", str(tenants)]
    for f in faults:
        cmd += ["--lab-fault", f]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp
    )
    try:
        url = None
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = URL_LINE.search(line)
            if m:
                url = m.group(1)
        if url is None:
            raise SystemExit(f"kvfence serve did not announce a URL (exit {proc.poll()})")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prefix_config(prefix_pages: int | None) -> PrefixSharingConfig:
    if prefix_pages is None:
        return PrefixSharingConfig(salt="off", stop_on_cached_evidence=False, design=DESIGN)
    return PrefixSharingConfig(
        prefix_pages=prefix_pages,
        min_prefix_tokens=prefix_pages * 16,
        salt="off",
        stop_on_cached_evidence=False,
        design=DESIGN,
    )


def report_prefix(label: str, res: CheckResult, seconds: float) -> None:
    ev = res.evidence.get("unsalted")
    if not isinstance(ev, dict) or not isinstance(ev.get("ks"), dict):
        print(
            f"prefix_sharing[{label}] verdict={res.verdict.value} no KS result: {res.summary} "
            f"load1={load1()}",
            flush=True,
        )
        return
    ks = ev["ks"]
    requests = int(ev["requests"])
    print(
        f"prefix_sharing[{label}] requests={requests} trials={ev['trials']} "
        f"p={ks['p_value']:.2e} threshold={ks['threshold_per_look']:.1e} "
        f"rejected={ks['rejected']} verdict={res.verdict.value} "
        f"prefix_tokens={res.evidence.get('prefix_tokens')} "
        f"cached_tokens_seen={ev['cross_tenant_cached_hits']} "
        f"ratio_vs_paper={requests / PAPER_REQUESTS:.2f} seconds={seconds:.1f} load1={load1()}",
        flush=True,
    )


def run_prefix(
    ctx: AuditContext, target: Target, cfg: PrefixSharingConfig
) -> tuple[CheckResult, float]:
    start = time.perf_counter()
    with ctx.open():
        res = run_check(PrefixSharingCheck(cfg), ctx, target)
    return res, time.perf_counter() - start


def prefix_kvfence(seed: int, prefix_pages: int) -> None:
    cfg = prefix_config(prefix_pages)
    for label, faults in (
        ("kvfence shared-prefix-cache", ("shared-prefix-cache",)),
        ("kvfence hardened baseline", ()),
    ):
        with (
            tempfile.TemporaryDirectory(prefix="kvfence-bench-prefix-") as tmp,
            kvfence_server(Path(tmp), faults) as url,
        ):
            ctx = AuditContext(
                key_a=KEY_A, key_b=KEY_B, seed=seed,
                budget=Budget(max_requests=1000, max_seconds=600),
            )  # fmt: skip
            res, seconds = run_prefix(ctx, KvfenceTarget(url), cfg)
        report_prefix(label, res, seconds)


def prefix_vllm(seed: int) -> None:
    cache = PeerCache.from_env()
    if not cache.vllm_installed():
        print(
            f"prefix_sharing[vllm default] skipped: vLLM peer not installed in {cache.root} "
            f"(run `make peers`)",
            flush=True,
        )
        return
    from kvfence.model.tiny import make_tiny_checkpoint  # torch: imported only here

    with tempfile.TemporaryDirectory(prefix="kvfence-bench-vllm-") as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        start = time.perf_counter()
        with start_vllm(
            ckpt,
            max_model_len=2048,
            enable_prompt_tokens_details=True,
            enforce_eager=True,
            log_dir=Path(tmp) / "log",
            cache=cache,
        ) as server:
            startup = time.perf_counter() - start
            # vLLM has no tenants: A and B are two callers of the same open endpoint.
            ctx = AuditContext(seed=seed, budget=Budget(max_requests=1000, max_seconds=600))
            res, seconds = run_prefix(ctx, VllmTarget(server.url), prefix_config(None))
    print(f"vllm_startup_s={startup:.1f} load1={load1()}", flush=True)
    report_prefix("vllm default", res, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kvfence-prefix-pages",
        type=int,
        default=64,
        help="prefix pages against kvfence serve (its default mirror model's prefill is cheap, "
        "so a short prefix saves little time)",
    )
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--skip-kvfence", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    if not args.skip_embedded:
        main_job_wall()
    if not args.skip_kvfence:
        prefix_kvfence(args.seed, args.kvfence_prefix_pages)
    if not args.skip_vllm:
        prefix_vllm(args.seed)


if __name__ == "__main__":
    main()
