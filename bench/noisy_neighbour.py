"""A noisy neighbour against a quiet one, through `kvfence serve` as shipped, in each mode.

Seeded. For each mode (single process `kvfence serve`; the hub `kvfence serve
--disaggregated --router kvfence`; the sglang-router stack `kvfence serve
--disaggregated`) and each setting (`default`: the generated tenants and the
server's default limits; `unlimited`: the same with `--unlimited-tenants`, the
baseline that shows what the limits buy), it starts the server from the CLI,
then measures the quiet tenant's ("tenant-b") p50 time to first token over
`--victim-requests` short streamed prompts, one at a time: idle (half before
the flood, half after), and while
tenant-a floods with `--flood-clients` clients sending near-context prompts back
to back (`--flood over-long`: prompts over the context, each refused with a 400).
The flood ignores Retry-After (an attacker would) but pauses `--flood-pause-ms`
after a 429 so the clients do not spin on the same 2 cores as the server.

Prints one line per run and a summary:

  noisy mode=single setting=default idle_p50_ms=... flood_p50_ms=... ratio=...x
  flood={200: .., 429: ..} load1=...

Usage: python bench/noisy_neighbour.py [--modes single,hub,sglang]
           [--settings default,unlimited] [--flood near-context|over-long] [--preset tiny]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODES = {
    "single": (),
    "hub": ("--disaggregated", "--router", "kvfence"),
    "sglang": ("--disaggregated",),
}
SETTINGS = {"default": (), "unlimited": ("--unlimited-tenants",)}
FLOODER, VICTIM = "tenant-a", "tenant-b"  # the generated tenants
URL_RE = re.compile(r" at (http://[0-9.:]+)")
KEY_RE = re.compile(r"^tenant (\S+): key (\S+)$", re.M)
WORDS = tuple(
    [
        "apple",
        "river",
        "stone",
        "cloud",
        "lamp",
        "orbit",
        "maple",
        "quartz",
        "ember",
        "delta",
        "violet",
        "harbor",
        "candle",
    ]
)


@dataclass(frozen=True, slots=True)
class Server:
    url: str
    keys: dict[str, str]
    model: str
    log: Path

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


@contextmanager
def serve(mode: str, setting: str, extra: tuple[str, ...], timeout_s: float) -> Iterator[Server]:
    """`kvfence serve` in `mode`, announced and healthy; stopped (its process group) on exit."""
    work = Path(tempfile.mkdtemp(prefix=f"noisy-{mode}-"))
    log = work / "serve.log"
    argv = [sys.executable, "-m", "kvfence", "serve", "--port", "0", *MODES[mode]]
    argv += [*SETTINGS[setting], *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield _announced(proc, log, timeout_s)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # the stack stops its router and workers on Ctrl-C
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _announced(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> Server:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        url, keys = URL_RE.search(text), dict(KEY_RE.findall(text))
        if url and {FLOODER, VICTIM} <= set(keys):
            server = Server(url.group(1), keys, "", log)
            models = httpx.get(f"{server.url}/v1/models", headers=server.auth(VICTIM), timeout=30)
            return Server(server.url, keys, models.json()["data"][0]["id"], log)
        if proc.poll() is not None:
            raise RuntimeError(f"kvfence serve exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.2)  # a log poll while the server starts (seconds)
    raise RuntimeError(f"kvfence serve did not announce in {timeout_s:.0f} s:\n{log.read_text()}")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt_tokens(server: Server, text: str) -> int:
    """The server's own count of a prompt's tokens (one generated token)."""
    body = {"model": server.model, "prompt": text, "max_tokens": 1, "temperature": 0}
    r = httpx.post(
        f"{server.url}/v1/completions", headers=server.auth(VICTIM), json=body, timeout=300
    )
    r.raise_for_status()
    return int(r.json()["usage"]["prompt_tokens"])


def ttft(client: httpx.Client, server: Server, tenant: str, prompt: str) -> float:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "stream": True}
    start = time.monotonic()
    with client.stream(
        "POST", f"{server.url}/v1/completions", headers=server.auth(tenant), json=body
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{tenant}'s request: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - start
    raise RuntimeError(f"{tenant}'s stream ended without a token")


def victim_ttfts(server: Server, rng: random.Random, n: int) -> list[float]:
    with httpx.Client(timeout=300) as client:
        return [ttft(client, server, VICTIM, words(rng, 6)) for _ in range(n)]


@dataclass
class Flood:
    """`clients` threads sending the flooder's prompts back to back until stopped."""

    server: Server
    prompt: str
    clients: int
    pause_s: float
    statuses: Counter[int] = field(default_factory=Counter)
    retry_after: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        body = {"model": self.server.model, "prompt": self.prompt, "max_tokens": 4}
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                try:
                    r = client.post(
                        f"{self.server.url}/v1/completions",
                        headers=self.server.auth(FLOODER),
                        json=body,
                    )
                    status, after = r.status_code, r.headers.get("retry-after")
                except httpx.HTTPError:
                    status, after = 0, None
                with self.lock:
                    self.statuses[status] += 1
                    if after is not None:
                        self.retry_after.add(after)
                if status != 200:
                    self.stop.wait(self.pause_s)

    @contextmanager
    def running(self, settle_s: float) -> Iterator[Flood]:
        threads = [threading.Thread(target=self.run, daemon=True) for _ in range(self.clients)]
        for t in threads:
            t.start()
        try:
            time.sleep(settle_s)  # let the flood fill whatever it may fill
            yield self
        finally:
            self.stop.set()
            for t in threads:
                t.join(timeout=600)


@dataclass(frozen=True, slots=True)
class Result:
    mode: str
    setting: str
    idle_s: float
    flood_s: float
    statuses: dict[int, int]
    retry_after: tuple[str, ...]
    load1: float

    @property
    def ratio(self) -> float:
        return self.flood_s / self.idle_s

    def line(self) -> str:
        return (
            f"noisy mode={self.mode} setting={self.setting} idle_p50_ms={self.idle_s * 1000:.1f} "
            f"flood_p50_ms={self.flood_s * 1000:.1f} ratio={self.ratio:.2f}x "
            f"flood={dict(sorted(self.statuses.items()))} retry_after={list(self.retry_after)} "
            f"load1={self.load1:.1f}"
        )


@dataclass(frozen=True, slots=True)
class Plan:
    seed: int = 0
    victim_requests: int = 12
    flood_clients: int = 8
    flood: str = "near-context"  # or "over-long"
    flood_share: float = 0.8  # of the context, for near-context prompts
    flood_pause_s: float = 0.05
    settle_s: float = 2.0
    extra: tuple[str, ...] = ()
    start_timeout_s: float = 300.0


def measure(mode: str, setting: str, plan: Plan) -> Result:
    rng = random.Random(plan.seed)
    with serve(mode, setting, plan.extra, plan.start_timeout_s) as server:
        flood_prompt = flooder_prompt(server, rng, plan)
        prompt_tokens(server, words(rng, 6))  # warm-up
        # Idle before and after the flood, pooled: on a shared machine one idle phase alone
        # moved with whatever else ran then.
        idle = victim_ttfts(server, rng, plan.victim_requests // 2)
        flood = Flood(server, flood_prompt, plan.flood_clients, plan.flood_pause_s)
        with flood.running(plan.settle_s):
            loaded = victim_ttfts(server, rng, plan.victim_requests)
        time.sleep(plan.settle_s)  # the flood's last requests drain
        idle += victim_ttfts(server, rng, plan.victim_requests - plan.victim_requests // 2)
        load1 = os.getloadavg()[0]
    retry = tuple(sorted(flood.retry_after))
    p50 = statistics.median
    return Result(mode, setting, p50(idle), p50(loaded), dict(flood.statuses), retry, load1)


def flooder_prompt(server: Server, rng: random.Random, plan: Plan) -> str:
    """Near-context text (its length measured by the server), or text over the context."""
    info = httpx.get(f"{server.url}/v1/models", headers=server.auth(VICTIM), timeout=30).json()
    context = int(info["data"][0].get("max_model_len") or 512)
    per_word = prompt_tokens(server, words(rng, 64)) / 64
    if plan.flood == "over-long":
        return words(rng, int(context * 1.5 / per_word) + 1)
    return words(rng, max(1, int(context * plan.flood_share / per_word)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="single,hub,sglang")
    p.add_argument("--settings", default="default,unlimited")
    p.add_argument("--flood", choices=("near-context", "over-long"), default="near-context")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--victim-requests", type=int, default=12)
    p.add_argument("--flood-clients", type=int, default=8)
    p.add_argument("--flood-pause-ms", type=float, default=50.0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `kvfence serve` args")
    a = p.parse_args(argv)
    plan = Plan(
        seed=a.seed,
        victim_requests=a.victim_requests,
        flood_clients=a.flood_clients,
        flood=a.flood,
        flood_pause_s=a.flood_pause_ms / 1000,
        extra=("--preset", a.preset, *a.serve_arg),
    )
    results = []
    for mode in a.modes.split(","):
        for setting in a.settings.split(","):
            results.append(measure(mode, setting, plan))
            print(results[-1].line(), flush=True)
    print("summary (victim TTFT p50 under the flood / idle):")
    for r in results:
        print(f"  {r.mode:7s} {r.setting:9s} x{r.ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
