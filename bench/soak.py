"""The 32-tenant soak against the disaggregated engine (router + prefill + decode over TCP).

Usage: python bench/soak.py [--seconds 60] [--tenants 32] [--lab-fault F ...]

Prefill and decode are `kvfence serve --role ...` processes on loopback; the
router (the real `PDBackend` + app) runs here so that every worker's ledger
report can be read at the end. Each tenant is one client sending, back to back
and seeded, a mix of short and near-limit prompts, streamed and not, streams
cut after their first chunk, and over-long prompts. Every prompt starts with
the tenant's own sentinel; the mirror model echoes what it attends to, so a
body holding another tenant's sentinel is a crossing. At the end: crossings,
the client's counts per outcome against the server's counters, pages in use
once quiet, and each worker's ledger integrity. Then the same length of
traffic from one tenant, for the throughput ratio. One result line; exit 1
if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvfence.faults import FaultSet
from kvfence.hub.backend import PDBackend, Timeouts
from kvfence.model.config import ModelConfig
from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.config import ServeConfig
from kvfence.serve.supervisor import free_port
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

CONTEXT = 512
LOOP = "tcp://127.0.0.1"
KINDS = ("short", "short-stream", "near-limit", "near-limit-stream", "cut-stream", "over-long")
WEIGHTS = (30, 30, 10, 10, 10, 10)


@dataclass
class Cluster:
    url: str
    backend: PDBackend
    tenants: TenantRegistry
    workers: dict[str, subprocess.Popen[bytes]]
    argv: dict[str, list[str]]
    tokenizer: Tokenizer

    def key(self, tenant: str) -> str:
        return next(t.keys[0] for t in self.tenants.tenants if t.name == tenant)

    def counters(self) -> Counter[str]:
        """The server's request outcomes, read from /metrics as any operator would."""
        text = httpx.get(
            self.url + "/metrics",
            headers={"Authorization": f"Bearer {self.tenants.operator_keys[0]}"},
        ).text
        out: Counter[str] = Counter()
        for line in text.splitlines():
            if line.startswith("kvfence_requests_total{"):
                outcome = line.split('outcome="')[1].split('"')[0]
                out[outcome] = int(float(line.rsplit(" ", 1)[1]))
        return out

    def kill(self, name: str) -> None:
        """kill -9: no clean-up of any kind."""
        self.workers[name].send_signal(signal.SIGKILL)
        self.workers[name].wait(timeout=30)

    def restart(self, name: str) -> None:
        """The same worker again, at the same inbox: it rejoins by reporting its status."""
        self.workers[name] = subprocess.Popen(self.argv[name])

    def addr(self, name: str) -> str:
        return self.argv[name][self.argv[name].index("--inbox") + 1]

    def wait_rejoined(self, name: str, deadline_s: float) -> bool:
        """Until the restarted worker's status arrives and it is no longer counted dead."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if (
                self.addr(name) not in self.backend.dead_workers()
                and self.workers[name].poll() is None
            ):
                status = self.backend.worker_status(self.addr(name))
                if status is not None and status.pages_used == 0:
                    return True
            time.sleep(0.2)
        return False

    def quiet(self, deadline_s: float = 60.0) -> tuple[dict[str, str], dict[str, int]]:
        """Once nothing is open and every live worker's ledger report is in: (reports, pages)."""
        end = time.monotonic() + deadline_s
        while True:
            dead = set(self.backend.dead_workers())
            reports = {a: r for a, r in self.backend.integrity().items() if a not in dead}
            pages = {"prefill": 0, "decode": 0}
            for p in self.backend.stats().pools:
                pages[p.role] += p.pages_used + p.pages_pending
            done = self.backend.open_rooms() == 0 and reports and all(reports.values())
            if done or time.monotonic() > end:
                return reports, pages
            time.sleep(0.1)


@contextmanager
def cluster(
    checkpoint: Path,
    names: Sequence[str],
    faults: Sequence[str] = (),
    kv_pages: str = "",
    workers_per_role: int = 1,
) -> Iterator[Cluster]:
    router_inbox = f"{LOOP}:{free_port()}"
    inboxes = {
        f"{role}-{i}": f"{LOOP}:{free_port()}"
        for role in ("prefill", "decode")
        for i in range(workers_per_role)
    }
    pages = kv_pages or "prefill=256,decode=256"
    fault_args = [x for f in faults for x in ("--lab-fault", f)]
    argv = {
        name: [
            sys.executable,
            "-m",
            "kvfence",
            "serve",
            "--role",
            name.split("-")[0],
            "--inbox",
            inbox,
            "--router-addr",
            router_inbox,
            "--model",
            str(checkpoint),
            "--model-kind",
            "mirror",
            "--transport",
            "tcp",
            "--kv-pages",
            pages,
            "--context-length",
            str(CONTEXT),
            "--no-prefix-cache",
            "--torch-threads",
            "1",
            *fault_args,
        ]
        for name, inbox in inboxes.items()
    }
    workers = {name: subprocess.Popen(a) for name, a in argv.items()}
    fs = FaultSet.parse(faults)
    backend = PDBackend(
        router_inbox,
        [a for n, a in inboxes.items() if n.startswith("prefill")],
        [a for n, a in inboxes.items() if n.startswith("decode")],
        faults=fs,
        timeouts=Timeouts(liveness_s=3.0),
    )
    backend.start()
    try:
        backend.wait_for_workers(240)
        config = ModelConfig.from_file(checkpoint / "config.json")
        serve_config = ServeConfig(
            model_name=checkpoint.name,
            context_length=CONTEXT,
            vocab_size=config.vocab_size,
            faults=fs,
            transport="tcp",
            disaggregated=True,
            prefix_cache=False,
            allow_undersized_pool="undersized-pool" in faults,
        )
        tenants = TenantRegistry.generate(tuple(names))
        tokenizer = Tokenizer.from_dir(checkpoint)
        app = create_app(backend, tokenizer, serve_config, tenants)
        with ServerThread(app) as srv:
            yield Cluster(srv.url, backend, tenants, workers, argv, tokenizer)
    finally:
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in workers.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        backend.stop()


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)  # the client's view
    kinds: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    crossings: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)  # 200s whose content is not whole
    lock: threading.Lock = field(default_factory=threading.Lock)


def sentinel(tenant: str) -> str:
    return f"ZQ{tenant}QZ"


def _prompt(c: Cluster, rng: random.Random, tenant: str, kind: str) -> tuple[list[int], int]:
    """Token ids: the tenant's sentinel first (the mirror echoes from the start), then filler."""
    head = c.tokenizer.encode(sentinel(tenant) + " ")
    filler = c.tokenizer.encode(f" lorem ipsum {rng.randrange(10**6)}")
    if kind.startswith("near-limit"):
        n, max_tokens = CONTEXT - 12, 8  # prompt + max_tokens a few tokens under the limit
    elif kind == "over-long":
        n, max_tokens = CONTEXT + 8, 4  # over the context: a 400, nothing allocated
    elif kind == "cut-stream":
        n, max_tokens = len(head) + 4, 400
    else:
        n, max_tokens = len(head) + 8, 8
    return (head + filler * (n // len(filler) + 1))[:n], max_tokens


def one_request(
    client: httpx.Client, c: Cluster, tenant: str, kind: str, rng: random.Random, tally: Tally
) -> None:
    prompt, max_tokens = _prompt(c, rng, tenant, kind)
    stream = kind.endswith("stream")
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind == "cut-stream":
        body["ignore_eos"] = True
    start = time.monotonic()
    text, got, outcome, first = "", "", "", None
    with client.stream("POST", c.url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            outcome = "rejected" if r.status_code < 500 else "failed"
        elif not stream:
            text = r.read().decode()
            first = time.monotonic() - start
            outcome = "finished"
            got = json.loads(text)["choices"][0]["text"]
        else:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if first is None:
                    first = time.monotonic() - start
                if kind == "cut-stream":
                    outcome = "aborted"  # the client hangs up after the first chunk
                    break
                if line == "data: [DONE]":
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    outcome = "failed"
                else:
                    got += event["choices"][0]["text"]
                text += json.dumps(event)
            outcome = outcome or "finished"
    # A fragment is enough: a stale read may miss the sentinel's first token (`ZQ`).
    foreign = [t.name for t in c.tenants.tenants if t.name != tenant and f"{t.name}QZ" in text]
    with tally.lock:
        tally.outcomes[outcome] += 1
        tally.kinds[kind] += 1
        if first is not None and outcome == "finished":
            tally.ttft.append(first)
        if foreign:
            tally.crossings.append(f"{tenant} ({kind}) read {foreign}")
        # The mirror echoes the prompt: a whole answer is exactly its first max_tokens tokens.
        if outcome == "finished" and not foreign and got != c.tokenizer.decode(prompt[:max_tokens]):
            tally.partial.append(f"{tenant} ({kind}) got {got!r}")


def traffic(
    c: Cluster,
    names: Sequence[str],
    seconds: float,
    seed: int,
    busy: threading.Event | None = None,
) -> Tally:
    """Until `seconds` have passed and `busy` (a crash plan at work) is clear."""
    tally = Tally()
    end = time.monotonic() + seconds
    hard_end = end + 300  # bounded whatever the plan does

    def tenant_loop(tenant: str, i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        headers = {"Authorization": f"Bearer {c.key(tenant)}"}
        with httpx.Client(headers=headers, timeout=120) as client:
            while time.monotonic() < end or (
                busy is not None and busy.is_set() and time.monotonic() < hard_end
            ):
                kind = rng.choices(KINDS, WEIGHTS)[0]
                one_request(client, c, tenant, kind, rng, tally)

    threads = [threading.Thread(target=tenant_loop, args=(t, i)) for i, t in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 300)
    return tally


@dataclass
class Result:
    served: int
    requests: int
    crossings: list[str]
    client: Counter[str]
    server: Counter[str]
    pages: dict[str, int]
    integrity: dict[str, str]
    p50_ms: float
    p99_ms: float
    throughput: float
    single_throughput: float
    kinds: Counter[str]
    partial: list[str]
    rejoined: dict[str, bool]

    @property
    def problems(self) -> list[str]:
        out = [f"crossing: {x}" for x in self.crossings[:5]]
        out += [f"200 without the whole answer: {x}" for x in self.partial[:5]]
        if self.client != self.server:
            out.append(f"client counts {dict(self.client)} != server {dict(self.server)}")
        if any(self.pages.values()):
            out.append(f"pages still in use once quiet: {self.pages}")
        out += [f"{name} did not rejoin" for name, ok in self.rejoined.items() if not ok]
        if not self.integrity or set(self.integrity.values()) != {"ok"}:
            out.append(f"ledger integrity: {self.integrity}")
        return out


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] * 1000 if len(xs) > 1 else 0.0


def soak(
    checkpoint: Path,
    *,
    seconds: float,
    tenants: int = 32,
    faults: Sequence[str] = (),
    kv_pages: str = "",
    seed: int = 0,
    baseline: bool = True,
    crashes: Sequence[tuple[float, str]] = (),
) -> Result:
    """`crashes`: (seconds into the run, worker) to kill -9 and restart 2 s later."""
    names = [f"t{i:02d}" for i in range(tenants)]
    per_role = 2 if crashes else 1
    with cluster(checkpoint, names, faults, kv_pages, per_role) as c:
        base = c.counters()
        busy = threading.Event()
        busy.set()
        plan = threading.Thread(target=_crash_plan, args=(c, crashes, busy), daemon=True)
        plan.start()
        tally = traffic(c, names, seconds, seed, busy)
        plan.join(timeout=120)
        integrity, pages = c.quiet()
        rejoined = {name: _served_since_restart(c, name) for _, name in crashes}
        server = c.counters() - base
        single = traffic(c, names[:1], seconds if baseline else 0, seed + 1)
        c.quiet()
    served = tally.outcomes["finished"]
    return Result(
        served=served,
        requests=sum(tally.outcomes.values()),
        crossings=tally.crossings,
        client=+tally.outcomes,
        server=+server,
        pages=pages,
        integrity=integrity,
        p50_ms=_pct(tally.ttft, 50),
        p99_ms=_pct(tally.ttft, 99),
        throughput=served / seconds,
        single_throughput=single.outcomes["finished"] / seconds,
        kinds=tally.kinds,
        partial=tally.partial,
        rejoined=rejoined,
    )


def _crash_plan(c: Cluster, crashes: Sequence[tuple[float, str]], busy: threading.Event) -> None:
    """Kill and restart each worker in turn; traffic goes on until each has rejoined and
    then carried requests for a few seconds (or a bound passed)."""
    start = time.monotonic()
    try:
        for at, name in crashes:
            time.sleep(max(0.0, start + at - time.monotonic()))
            c.kill(name)
            time.sleep(2.0)
            c.restart(name)
            c.wait_rejoined(name, 120.0)
        time.sleep(8.0 if crashes else 0.0)
    finally:
        busy.clear()


def _served_since_restart(c: Cluster, name: str) -> bool:
    """The restarted worker is live and its (new) counters show requests it carried.

    A prefill worker finishes nothing itself: what it carried shows as KV it transferred
    (a decode worker's as requests it finished). Counting only finished, rejected and
    aborted missed a prefill worker that carried 1,508 transfers and saw no abort."""
    addr = c.addr(name)
    status = c.backend.worker_status(addr)
    if status is None:
        return False
    n = status.counters
    carried = n.finished + n.rejected + n.aborted + n.transferred
    return addr not in c.backend.dead_workers() and carried > 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--lab-fault", action="append", default=[])
    ap.add_argument("--kv-pages", default="")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvfence-soak-") as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        r = soak(
            ckpt,
            seconds=args.seconds,
            tenants=args.tenants,
            faults=args.lab_fault,
            kv_pages=args.kv_pages,
            seed=args.seed,
        )
    print(
        f"soak {args.tenants} tenants {args.seconds:g}s: requests {r.requests} served {r.served} "
        f"crossings {len(r.crossings)} outcomes {dict(r.client)} server {dict(r.server)} "
        f"ttft p50 {r.p50_ms:.0f} ms p99 {r.p99_ms:.0f} ms throughput {r.throughput:.1f}/s "
        f"(single tenant {r.single_throughput:.1f}/s) pages {r.pages} "
        f"integrity {sorted(set(r.integrity.values()))} load {os.getloadavg()[0]:.1f}"
    )
    for p in r.problems:
        print("FAIL", p)
    return 1 if r.problems else 0


if __name__ == "__main__":
    sys.exit(main())
