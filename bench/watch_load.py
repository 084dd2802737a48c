"""The load `kvfence watch` adds at its default settings, against target throughput, same run.

One `kvfence serve` target (two probe tenants, one load tenant, an operator key) and
one `kvfence watch --target URL --listen ...` with every other setting at its default
(interval, request budget per minute, canary and timing probes on). The watcher runs
its first interval (detection, capacity gate, boundary probe) before anything is
measured, then the run alternates phases of equal length: the watcher paused
(SIGSTOP: the baseline) and running (SIGCONT). In every phase a closed-loop seeded
load (each phase its own prompts: random token ids, `--concurrency` streams, fixed
output length, `ignore_eos`) is timed; throughput is its output tokens over the
phase's wall time. The watcher's requests are read from its own /metrics
(`kvfence_guard_requests_total`: fact reads, gate, probes) at the end of every running
phase, so requests per minute are measured, not assumed. After a pause the watcher
catches up at once (its interval elapsed while stopped), so a running phase holds at
least as many intervals as its length allows: the cost is, if anything, overstated.

The machine is shared, so wall-clock throughput moves with other processes' load:
paused and running phases alternate and each adjacent pair gives a ratio. A second
figure that other processes barely move comes from the target's own CPU time (/proc):
with no load, the target's CPU-seconds per second with the watcher running minus
paused is what serving the watcher costs; divided by the CPU-seconds per second the
target spends serving the load, it is the share of capacity the watcher takes
(capacity ratio = 1 - share).

Prints one line per phase (with the 1-minute load average), then one result line:
watcher requests per minute, throughput with / without and per pair, and the capacity
ratio (goal >= 0.98). At the default spacing (a round of d seconds is followed by the next
no sooner than d / 2% after it began) a round on a large model can be rarer than a phase,
so the phases may hold no round at all; the run says how many rounds it held, and a last
line measures one round on its own (the watcher's code in-process at its defaults, the
watcher paused, no load): its requests, wall time and target CPU seconds, against an
interval with no round due, and the steady request rate they imply.

Usage: python bench/watch_load.py [--preset smollm|tiny] [--phases 6] [--phase-s 60]
           [--concurrency 4] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.peers import PeerServer, free_port, launch_server  # noqa: E402
from bench.serve_throughput import FIRST_ID, one_request, percentile  # noqa: E402

from kvfence.model.tiny import PRESETS, default_checkpoint_dir  # noqa: E402

KEYS = {
    "probe-a": "sk-bench-watch-a-0123456789",
    "probe-b": "sk-bench-watch-b-0123456789",
    "load": "sk-bench-watch-load-0123456",
}
OPERATOR = "sk-bench-watch-operator-01234"
REQUESTS_METRIC = "kvfence_guard_requests_total"


@dataclass(frozen=True, slots=True)
class Phase:
    index: int
    watcher: bool
    tok_s: float
    requests: int
    errors: int
    ttft_p50_ms: float
    wall_s: float
    load1: float
    target_cpu_s: float  # CPU seconds the target process spent in the phase
    first_error: str | None

    def line(self) -> str:
        mode = "watcher running" if self.watcher else "watcher paused "
        return (
            f"  phase {self.index}: {mode} out_tok_s={self.tok_s:8.1f} "
            f"requests={self.requests} errors={self.errors} "
            f"ttft_p50_ms={self.ttft_p50_ms:7.1f} wall_s={self.wall_s:6.1f} "
            f"target_cpu_s={self.target_cpu_s:6.1f} "
            f"load1={self.load1:.1f}"
            + (f" first_error={self.first_error}" if self.first_error else "")
        )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load_phase(
    url: str,
    model: str,
    seconds: float,
    concurrency: int,
    rng: random.Random,
    args: argparse.Namespace,
) -> tuple[int, int, list[str], list[float], float]:
    """Closed-loop streams until the deadline; (tokens, requests, errors, ttfts_ms, wall_s)."""
    id_limit = PRESETS[args.preset].tokenizer_size
    headers = {"Authorization": f"Bearer {KEYS['load']}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    tokens = requests = 0
    errors: list[str] = []
    ttfts: list[float] = []
    async with httpx.AsyncClient(limits=limits, timeout=600.0, headers=headers) as client:
        start = time.perf_counter()
        deadline = start + seconds

        async def stream() -> None:
            nonlocal tokens, requests
            while time.perf_counter() < deadline:
                n = rng.randint(args.prompt_min, args.prompt_max)
                prompt = [rng.randrange(FIRST_ID, id_limit) for _ in range(n)]
                out = await one_request(client, url, model, prompt, args.output_tokens, True)
                requests += 1
                if out.error is not None:
                    errors.append(out.error)
                    continue
                tokens += out.output_tokens
                ttfts.append(out.ttft_s * 1000)

        await asyncio.gather(*(stream() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return tokens, requests, errors, ttfts, wall


def start_target(preset: str, tmp: Path, context: int) -> PeerServer:
    tenants = tmp / "tenants.json"
    entries = [{"name": n, "keys": [k]} for n, k in KEYS.items()]
    tenants.write_text(json.dumps({"tenants": entries, "operator_keys": [OPERATOR]}))
    port = free_port()
    model_dir = default_checkpoint_dir(preset=preset)
    cmd = [str(Path(sys.executable).parent / "kvfence"), "serve", "--model", str(model_dir)]
    cmd += ["--model-kind", "llama", "--tenants", str(tenants), "--port", str(port)]
    cmd += ["--context-length", str(context)]
    return launch_server("kvfence", cmd, dict(os.environ), port, model_dir.name, "/health", tmp)


def start_watcher(url: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "kvfence"), "watch", "--target", url]
    cmd += ["--key-a", KEYS["probe-a"], "--key-b", KEYS["probe-b"], "--operator-key", OPERATOR]
    cmd += ["--listen", f"127.0.0.1:{port}"]
    log = (tmp / "watch.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/metrics"


def watcher_requests(metrics_url: str, series: str = REQUESTS_METRIC + "{") -> float | None:
    """The watcher's own count of requests sent (None until its first interval ended); or
    the first series whose line starts with `series`."""
    try:
        text = httpx.get(metrics_url, timeout=10.0).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(series):
            return float(line.rsplit(" ", 1)[1])
    return None


def rounds_so_far(metrics_url: str) -> str:
    """Probe rounds the watcher ran (timing probes / round size) and intervals it skipped."""
    from kvfence.watch.probes import ROUND

    timing = watcher_requests(metrics_url, 'kvfence_guard_probes_total{kind="timing"')
    skipped = watcher_requests(metrics_url, "kvfence_guard_probes_skipped_total{")
    return (
        f"probe rounds run {(timing or 0) / ROUND:.0f}, rounds skipped (spacing) {skipped or 0:.0f}"
    )


def wait_first_interval(proc: subprocess.Popen[bytes], metrics_url: str, timeout: float) -> float:
    """Block until the watcher finished its first interval (gate + boundary + probes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvfence watch exited {proc.returncode}")
        sent = watcher_requests(metrics_url)
        if sent:
            return sent
        time.sleep(1.0)
    raise RuntimeError("kvfence watch did not finish its first interval in time")


def round_cost(target: PeerServer) -> str:
    """One probe round measured on its own, the watcher paused, no load: the watcher's code
    at its defaults in-process (first interval: detection, gate, boundary, a round), then one
    more interval with the round due, timed with the target's CPU seconds."""
    from kvfence.watch.guard import GuardConfig, Keys, TargetGuard
    from kvfence.watch.metrics import WatchMetrics

    config = GuardConfig()
    keys = Keys(KEYS["probe-a"], KEYS["probe-b"], OPERATOR)
    guard = TargetGuard(target.url, "kvfence", keys, config, WatchMetrics())
    try:
        guard.cycle()
        reads_only = _timed(guard, target, due=False)
        one_round = _timed(guard, target, due=True)
    finally:
        guard.close()
    (r0, w0, c0), (r1, w1, c1) = reads_only, one_round
    gap = w1 / config.max_target_share
    per_min = (r1 - r0) * 60 / max(gap, config.interval_s) + r0 * 60 / config.interval_s
    return (
        f"per-round cost (idle target, watcher defaults): an interval with no round due "
        f"{r0} requests {w0:.2f} s target_cpu_s={c0:.3f}; with the round {r1} requests "
        f"{w1:.2f} s target_cpu_s={c1:.3f}; at the default share "
        f"({config.max_target_share:.0%}) the next round waits {gap:.0f} s, so the steady "
        f"load is ~{per_min:.1f} requests/min; load1={os.getloadavg()[0]:.1f}"
    )


def _timed(guard: object, target: PeerServer, *, due: bool) -> tuple[int, float, float]:
    """(requests, wall s, target CPU s) of one guard interval; `due` makes its round run now."""
    from kvfence.watch.guard import TargetGuard

    assert isinstance(guard, TargetGuard)
    guard.sent_at.clear()  # the per-minute budget is not what is measured here
    guard.next_round_at = 0.0 if due else time.monotonic() + 3600.0
    sent0, cpu0, t0 = guard.ctx.budget.sent, cpu_seconds(target.pid), time.perf_counter()
    guard.cycle()
    wall = time.perf_counter() - t0
    return guard.ctx.budget.sent - sent0, wall, cpu_seconds(target.pid) - cpu0


def run(args: argparse.Namespace, log_dir: Path) -> None:
    target = start_target(args.preset, log_dir, args.context)
    watcher, metrics_url = start_watcher(target.url, log_dir)
    try:
        first = wait_first_interval(watcher, metrics_url, 600.0)
        print(
            f"target ready in {target.ready_s:.1f} s; watcher's first interval: {first:.0f} "
            f"requests (detection, gate, boundary, probes)",
            flush=True,
        )
        measure(args, target, watcher, metrics_url, first)
        os.killpg(watcher.pid, signal.SIGSTOP)
        print(round_cost(target), flush=True)
    finally:
        os.killpg(watcher.pid, signal.SIGCONT)
        os.killpg(watcher.pid, signal.SIGTERM)
        watcher.wait(timeout=30)
        target.stop(grace=20.0)


def measure(
    args: argparse.Namespace,
    target: PeerServer,
    watcher: subprocess.Popen[bytes],
    metrics_url: str,
    first: float,
) -> None:
    headers = {"Authorization": f"Bearer {KEYS['load']}"}
    models = httpx.get(target.url + "/v1/models", headers=headers, timeout=30.0).json()
    model = str(models["data"][0]["id"])
    phases = [load_step(args, target, watcher, model, i) for i in range(args.phases)]
    after = watcher_requests(metrics_url)
    print(f"  watcher so far: {rounds_so_far(metrics_url)}", flush=True)
    running_s = sum(p.wall_s for p in phases if p.watcher)
    rpm = (after - first) / (running_s / 60) if after is not None else float("nan")
    idle, alone, alone_rpm = idle_pair(args, target, watcher, metrics_url, after)
    pairs = list(zip(phases[0::2], phases[1::2], strict=True))  # (paused, running), adjacent
    wall_ratios = sorted(r.tok_s / p.tok_s for p, r in pairs)
    base = sum(p.tok_s for p, _ in pairs) / len(pairs)
    with_w = sum(r.tok_s for _, r in pairs) / len(pairs)
    busy = sum(p.target_cpu_s / p.wall_s for p in phases) / len(phases)  # cores busy under load
    share = (alone - idle) / busy if busy > 0 else float("nan")
    print(
        f"watch_load: preset={args.preset} context={args.context} concurrency={args.concurrency} "
        f"watcher defaults (interval 60 s, <= 60 requests/min, canary + timing): "
        f"{rpm:.1f} requests/min under load, {alone_rpm:.1f} alone; throughput without "
        f"{base:.1f} / with {with_w:.1f} out tok/s, ratio {with_w / base:.3f} (per pair "
        f"{_fmt(wall_ratios)}); the watcher's requests cost the target {alone - idle:.3f} CPU-s/s "
        f"alone vs {busy:.2f} CPU-s/s serving the load: capacity ratio {1 - share:.4f} "
        f"(goal >= 0.98); load1={os.getloadavg()[0]:.1f}",
        flush=True,
    )


def load_step(
    args: argparse.Namespace,
    target: PeerServer,
    watcher: subprocess.Popen[bytes],
    model: str,
    i: int,
) -> Phase:
    """One load phase; the watcher paused on even phases (first: the baseline), running on odd."""
    on = i % 2 == 1
    os.killpg(watcher.pid, signal.SIGCONT if on else signal.SIGSTOP)
    rng = random.Random(args.seed * 1000 + i)
    cpu0 = cpu_seconds(target.pid)
    tokens, n, errors, ttfts, wall = asyncio.run(
        load_phase(target.url, model, args.phase_s, args.concurrency, rng, args)
    )
    if not target.alive():
        raise RuntimeError(f"the target exited during phase {i}:\n{target.log_tail(60)}")
    cpu = cpu_seconds(target.pid) - cpu0
    first_error = errors[0][:160] if errors else None
    phase = Phase(
        i, on, tokens / wall, n, len(errors), percentile(ttfts, 50), wall,
        os.getloadavg()[0], cpu, first_error,
    )  # fmt: skip
    print(phase.line(), flush=True)
    return phase


def idle_pair(
    args: argparse.Namespace,
    target: PeerServer,
    watcher: subprocess.Popen[bytes],
    metrics_url: str,
    sent: float | None,
) -> tuple[float, float, float]:
    """No load: the target's CPU-s/s with the watcher paused, then running; and its rate."""
    rates = []
    for on in (False, True):
        os.killpg(watcher.pid, signal.SIGCONT if on else signal.SIGSTOP)
        cpu0, t0 = cpu_seconds(target.pid), time.monotonic()
        time.sleep(args.phase_s)
        wall = time.monotonic() - t0
        rates.append((cpu_seconds(target.pid) - cpu0) / wall)
        print(
            f"  idle: watcher {'running' if on else 'paused '} target_cpu_s_per_s={rates[-1]:.4f} "
            f"wall_s={wall:.1f} load1={os.getloadavg()[0]:.1f}",
            flush=True,
        )
    after = watcher_requests(metrics_url)
    alone_rpm = (after - sent) / (args.phase_s / 60) if after and sent else float("nan")
    return rates[0], rates[1], alone_rpm


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm")
    ap.add_argument("--context", type=int, default=2048, help="the target's context length")
    ap.add_argument("--phases", type=int, default=6, help="alternating paused/running, even")
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny preset, 2 phases of 60 s")
    args = ap.parse_args()
    if args.quick:
        args.preset, args.phases, args.phase_s = "tiny", 2, 60.0
    if args.phases < 2 or args.phases % 2:
        ap.error("--phases must be even and >= 2 (paused and running alternate)")
    print(
        f"watch_load: cores={os.cpu_count()} seed={args.seed} phases={args.phases}x"
        f"{args.phase_s:g}s load1={os.getloadavg()[0]:.1f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvfence-watch-load-") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
