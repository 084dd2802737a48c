"""Behind sglang-router, one tenant's refusals never take the fleet down for the others.

The real stack on loopback (`sglang_stack/stack.py`: kvfence workers, the real
sglang-router), every tenant with the default limits. Tenant "flood" sends
`FLOOD_CLIENTS` concurrent near-limit prompts, so the workers refuse most of
them (429: over its queued tokens or in-flight requests). sglang-router turns a
worker's 429 into a 500 (the stack's edge gives the client its 429 back) and, with its
default circuit breaker, counts it
against the worker: 28 of them opened every circuit and every tenant got 503
"all circuits open" for the breaker's 60 s. The stack keeps the breaker shut
(`ROUTER_FAILURE_ARGS`), so "quiet" is served during and after the flood;
with the router's defaults put back the same flood leaves "quiet" with 503s:
`test_with_the_routers_default_breaker_the_flood_takes_the_fleet_down`. Those two
give "flood" no concurrency bound and no refusal bucket, so every request reaches
the workers and they do the refusing; with its default limits the stack's edge
refuses most of the flood itself, before the router:
`test_the_edge_holds_a_tenants_limits_before_the_router`.
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvfence.lab.profiles import Scale
from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.serve.limits import TenantLimits
from kvfence.serve.tenants import Tenant, TenantRegistry
from kvfence.sglang_stack.stack import Stack, StackSpec

SCALE = Scale()  # context 512, prefill pool 336: the defaults admit one such prompt waiting
FLOOD_CLIENTS = 16
FLOOD_ROUNDS = 2
PROMPT = "hello " * 100  # 300 tokens: near the per-request limit (336)
# sglang-router's own defaults (0.3.2), given after the stack's: argparse takes the last.
ROUTER_DEFAULTS = ("--cb-failure-threshold", "10", "--retry-max-retries", "5")
# The attacker's floods against the unguarded fleet, each twice the last, until a breaker
# opens: how many of a flood's refusals come in a row (what opens a breaker) follows the
# host's speed, and a fast host served three floods of 16 without one.
ESCALATING_FLOODS = (FLOOD_CLIENTS, 2 * FLOOD_CLIENTS, 4 * FLOOD_CLIENTS, 8 * FLOOD_CLIENTS)
# Only the prompt-token bound, which the workers keep: the edge passes every request on.
WORKERS_REFUSE = TenantLimits(max_concurrent=None, refusal_burst=None)


@dataclass
class Seen:
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    bodies: dict[tuple[str, int], str] = field(default_factory=dict)
    retry_after: Counter[tuple[str, int]] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, tenant: str, r: httpx.Response) -> None:
        with self.lock:
            self.statuses[tenant, r.status_code] += 1
            self.bodies.setdefault((tenant, r.status_code), r.text[:300])
            if r.headers.get("retry-after", "").isdigit():
                self.retry_after[tenant, r.status_code] += 1


@dataclass(frozen=True)
class Fleet:
    url: str
    keys: dict[str, str]
    stack: Stack

    def refused_at_workers(self, tenant: str) -> int:
        """The tenant's refusals counted by the workers' own limits, summed over them."""
        total = 0
        for worker in self.stack.workers:
            info = httpx.get(
                f"{self.stack.router_url_of(worker)}/server_info",
                headers={"Authorization": f"Bearer {self.keys[tenant]}"},
                timeout=30,
            )
            info.raise_for_status()
            total += int(info.json()["admission"]["refused"])
        return total


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@contextmanager
def _stack(
    checkpoint: Path,
    tmp: Path,
    router_args: tuple[str, ...],
    flood_limits: TenantLimits = WORKERS_REFUSE,
) -> Iterator[Fleet]:
    key = lambda: f"sk-kvf-{secrets.token_hex(16)}"  # noqa: E731
    tenants = TenantRegistry((Tenant("flood", (key(),), flood_limits), Tenant("quiet", (key(),))))
    (tmp / "tenants.json").write_text(tenants.to_json())
    args = [
        "--model", str(checkpoint), "--model-kind", "mirror",
        "--context-length", str(SCALE.context_length), "--page-size", str(SCALE.page_size),
        "--kv-pages", f"prefill={SCALE.prefill_pages},decode={SCALE.decode_pages}",
        "--torch-threads", "1", "--transport", "tcp", "--no-prefix-cache",
        "--allow-undersized-pool",
    ]  # fmt: skip
    spec = StackSpec(tuple(args), tmp / "tenants.json", router_args=router_args)
    with Stack(spec, workdir=tmp) as stack:
        yield Fleet(stack.url, {t.name: t.keys[0] for t in tenants.tenants}, stack)


def _post(fleet: Fleet, tenant: str) -> httpx.Response:
    return httpx.post(
        f"{fleet.url}/v1/completions",
        headers={"Authorization": f"Bearer {fleet.keys[tenant]}"},
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        timeout=120,  # a refused pair's other half may wait out its KV timeout (30 s)
    )


def _flood_then_quiet(fleet: Fleet, clients: int = FLOOD_CLIENTS) -> Seen:
    """The flood, with "quiet" sending one request at a time beside it, then three after."""
    seen = Seen()
    done = threading.Event()

    def flood() -> None:
        for _ in range(FLOOD_ROUNDS):
            seen.note("flood", _post(fleet, "flood"))

    def quiet_beside() -> None:
        while not done.is_set():
            seen.note("quiet-during", _post(fleet, "quiet"))

    threads = [threading.Thread(target=flood) for _ in range(clients)]
    beside = threading.Thread(target=quiet_beside)
    for t in [*threads, beside]:
        t.start()
    for t in threads:
        t.join(timeout=600)
    done.set()
    beside.join(timeout=200)
    for _ in range(3):
        seen.note("quiet-after", _post(fleet, "quiet"))
    print(dict(seen.statuses), {k: v for k, v in seen.bodies.items() if k[1] != 200})
    return seen


def _refused_for_limits(seen: Seen) -> bool:
    refused = [v for (t, s), v in seen.bodies.items() if t == "flood" and s != 200]
    return any("admission limit" in v or "refused too often" in v for v in refused)


def test_one_tenants_refusals_leave_the_others_served(checkpoint: Path, tmp_path: Path) -> None:
    with _stack(checkpoint, tmp_path, ()) as fleet:
        seen = _flood_then_quiet(fleet)
        assert _refused_for_limits(seen), seen.bodies  # the flood was refused for its limits
        # ... with a 429 and Retry-After, as a single server answers it: the router hands a
        # worker's 429 on as a 500, and the edge restores it from the refusal's code.
        assert seen.statuses["flood", 429] == seen.retry_after["flood", 429] > 0, seen.bodies
        assert ("flood", 500) not in seen.statuses, seen.bodies
        quiet = {(t, s): n for (t, s), n in seen.statuses.items() if t.startswith("quiet")}
        assert set(quiet) <= {("quiet-during", 200), ("quiet-after", 200)}, seen.bodies
        assert quiet["quiet-after", 200] == 3, quiet
        assert not any(s == 503 for (_, s) in seen.statuses), seen.bodies
        # The hardest of the floods that take the unguarded fleet down leaves this one serving.
        hardest = _flood_then_quiet(fleet, ESCALATING_FLOODS[-1])
        assert hardest.statuses["quiet-after", 200] == 3, dict(hardest.statuses)
        assert not any(s in (500, 503) for (_, s) in hardest.statuses), hardest.bodies


def test_with_the_routers_default_breaker_the_flood_takes_the_fleet_down(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The fix taken out (sglang-router's own breaker and retries): the check above fails.

    The router retries each refusal with a backoff, so one flood's refusals can all be retried
    into 200s before ten in a row open a breaker; the attacker floods again, harder, and so
    does this test (ESCALATING_FLOODS). With the fix in, no flood takes the fleet down (the
    test above, which also sends the hardest of these floods)."""
    with _stack(checkpoint, tmp_path, ROUTER_DEFAULTS) as fleet:
        for clients in ESCALATING_FLOODS:
            seen = _flood_then_quiet(fleet, clients)
            if seen.statuses["quiet-after", 503]:
                break
        # (The flood itself sees 503s too: the router retried its refusals until they were.)
        assert seen.statuses["quiet-after", 503] > 0, dict(seen.statuses)
        assert "all circuits open" in seen.bodies["quiet-after", 503]


def test_the_edge_holds_a_tenants_limits_before_the_router(
    checkpoint: Path, tmp_path: Path
) -> None:
    """With the default limits, most of the flood is refused at the edge: 429s that no
    worker counted (without the edge's limits every 429 is some worker's refusal)."""
    # No prompt-token bound: a worker refuses only over the in-flight bound, which the
    # edge's count (the whole of each request's life) reaches first.
    with _stack(checkpoint, tmp_path, (), TenantLimits(max_queued_tokens=None)) as fleet:
        seen = _flood_then_quiet(fleet)
        refused = seen.statuses["flood", 429]
        assert refused == seen.retry_after["flood", 429] > 0, seen.bodies
        at_workers = fleet.refused_at_workers("flood")  # each refused there counts 1 or 2
        assert at_workers < refused / 2, (at_workers, refused, seen.bodies)
        assert seen.statuses["quiet-after", 200] == 3, dict(seen.statuses)
