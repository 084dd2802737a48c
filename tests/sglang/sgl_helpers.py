"""The real stack for the tests: kvfence workers behind the real sglang-router, on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvfence.engine.backend import GenerateWork
from kvfence.engine.decode import DecodeEngine
from kvfence.engine.messages import SamplingParams
from kvfence.engine.prefill import PrefillEngine
from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import KVPool
from kvfence.lab.profiles import Scale
from kvfence.lab.scenario import Exchange, find_leak
from kvfence.model.base import CausalLM
from kvfence.model.loader import LoadedModel, load_model
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.specs import WorkerSpec, engine_config
from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.decode import DecodeSide
from kvfence.sglang_stack.prefill import PrefillSide
from kvfence.sglang_stack.stack import Stack, StackSpec
from kvfence.transfer.registry import get_transport

SCALE = Scale()  # the incident's numbers scaled down: context 512, prefill pool 336, decode 1024
OPERATOR_KEY = "sk-operator-sglang-tests-0001"


@dataclass(frozen=True, slots=True)
class Fleet:
    stack: Stack
    keys: dict[str, str]
    tokenizer: Tokenizer
    model: str

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def operator_url(self) -> str:
        """The router's own listener (loopback): where the operator audits the fleet."""
        return self.stack.admin_url

    def worker(self, role: str) -> Any:
        return next(w for w in self.stack.workers if w.role == role)

    def facts(self, role: str) -> dict[str, Any]:
        """What the worker tells the router (its live pool and ledger check), on the router's path."""
        url = self.stack.router_url_of(self.worker(role))
        return dict(httpx.get(f"{url}/server_info", timeout=10).json())


@contextmanager
def fleet(
    checkpoint: Path,
    tmp: Path,
    faults: FaultSet | None = None,
    transport: str = "tcp",
    prefix_cache: bool = False,
    edge: bool = True,
    keyed_control_plane: bool = True,  # False where `kvfence audit` reads the fleet (below)
) -> Iterator[Fleet]:
    """The stack; `operator_url` is its router's own loopback listener.

    `kvfence audit` reads the router's `/workers` with the tenant key (it sends the operator
    key only on the operator-data paths), so a fleet it audits there starts with that
    listener's control plane keyless (`keyed_control_plane=False`).
    """
    faults = faults or FaultSet()
    tenants = TenantRegistry.generate(("tenant-a", "tenant-b")).with_operator_keys((OPERATOR_KEY,))
    tenants_file = tmp / "tenants.json"
    tenants_file.write_text(tenants.to_json())
    args = [
        "--model", str(checkpoint), "--model-kind", "mirror",
        "--context-length", str(SCALE.context_length), "--page-size", str(SCALE.page_size),
        "--kv-pages", f"prefill={SCALE.prefill_pages},decode={SCALE.decode_pages}",
        "--torch-threads", "1", "--transport", transport,
    ]  # fmt: skip
    if not prefix_cache:
        args.append("--no-prefix-cache")
    if Fault.UNDERSIZED_POOL not in faults:
        args.append("--allow-undersized-pool")  # the honest mode: the edge rejects over-pool
    for f in faults.names():
        args += ["--lab-fault", f]
    spec = StackSpec(tuple(args), tenants_file, edge=edge, keyed_control_plane=keyed_control_plane)
    with Stack(spec, workdir=tmp) as stack:
        keys = {t.name: t.keys[0] for t in tenants.tenants}
        yield Fleet(stack, keys, Tokenizer.from_dir(checkpoint), checkpoint.name)


def text_of(tokenizer: Tokenizer, unit: str, n_tokens: int) -> str:
    """Text that encodes to about `n_tokens` (within one unit); the router takes text prompts only."""
    per = len(tokenizer.encode(unit * 8)) / 8
    return unit * max(1, int(n_tokens / per))


def complete(fleet: Fleet, tenant: str, prompt: str, max_tokens: int, **extra: Any) -> Exchange:
    body = {"model": fleet.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(
        f"{fleet.url}/v1/completions",
        headers={"Authorization": f"Bearer {fleet.keys[tenant]}"},
        json={**body, **extra},
        timeout=60,
    )
    obj = r.json()
    if r.status_code == 200:
        text = "".join(c.get("text", "") for c in obj.get("choices", []))
    else:
        text = str(obj.get("error", {}).get("message", ""))
    return Exchange(tenant, len(fleet.tokenizer.encode(prompt)), r.status_code, obj, text)


def wait_quiet(fleet: Fleet, role: str, timeout: float = 15.0) -> dict[str, Any]:
    """The worker's facts once its pool is empty and its ledger check ran (or the last seen)."""
    end = time.monotonic() + timeout
    facts = fleet.facts(role)
    while time.monotonic() < end:
        if facts["pages_used"] == 0 and facts["pages_pending"] == 0 and facts["integrity"]:
            return facts
        time.sleep(0.2)
        facts = fleet.facts(role)
    return facts


@dataclass(frozen=True, slots=True)
class Incident:
    sentinel: str
    a: tuple[Exchange, ...]
    b: Exchange
    leaked: str | None


def incident(fleet: Fleet) -> Incident:
    """lab/scenario.py through the router: A's sentinel traffic, then B's over-pool prompt."""
    sentinel = "ZQXTBNVLQJ"
    pool = SCALE.prefill_pool_tokens
    a_prompt = text_of(fleet.tokenizer, f"{sentinel} invoice ", int(pool * 0.8))
    b_prompt = text_of(fleet.tokenizer, "weather report ", (pool + SCALE.context_length) // 2)
    a = tuple(complete(fleet, "tenant-a", a_prompt, 8, ignore_eos=True) for _ in range(2))
    b = complete(fleet, "tenant-b", b_prompt, SCALE.page_size * 4, ignore_eos=True)
    return Incident(sentinel, a, b, find_leak(b, sentinel, fleet.tokenizer))


def clean_reject(inc: Incident) -> bool:
    """B's over-pool prompt ended as an error through the router, with nothing of A's in it."""
    b = inc.b
    return 400 <= b.status < 500 and "error" in b.body and inc.leaked is None


AUDIT_CHECKS = "capacity,boundary,canary,counters"


def audit_verdicts(
    url: str, keys: dict[str, str], operator: str, out: Path, checks: str = AUDIT_CHECKS
) -> dict[str, str]:
    """`kvfence audit` in-process against `url`: each check's verdict."""
    import json

    from click.testing import CliRunner

    from kvfence.cli import main

    args = ["audit", "--target", url, "--key-a", keys["tenant-a"], "--key-b", keys["tenant-b"]]
    args += ["--operator-key", operator, "--checks", checks, "--quiet", "--json", str(out)]
    CliRunner().invoke(main, args, catch_exceptions=False)
    rep = json.loads(out.read_text())
    return {r["check"]: r["verdict"] for r in rep["results"]}


def over_long_probe(report: Path, kind: str) -> dict[str, Any]:
    """The canary's `kind` ("pool"/"limit") + 1 probe, with its measured length, from a report."""
    import json

    rep = json.loads(report.read_text())
    canary = next(r for r in rep["results"] if r["check"] == "canary")
    probes = canary["evidence"]["over_long_probes"]
    return dict(next(p for p in probes if p["label"].startswith(f"over-{kind}")))


def edge_verdicts(checkpoint: Path, faults: FaultSet, out: Path) -> dict[str, str]:
    """The same audit at kvfence's own edge (the single-process lab server, same switches)."""
    from kvfence.lab.scenario import OPERATOR, lab_server

    with lab_server(checkpoint, faults, model_kind="mirror", scale=SCALE) as srv:
        return audit_verdicts(srv.url, srv.keys, srv.keys[OPERATOR], out)


LOOPBACK = "tcp://127.0.0.1:0"


def decode_side(checkpoint: Path, loaded: LoadedModel, **options: Any) -> DecodeSide:
    """A real decode side, not started: the mirror model, a TCP receiver into 64 pages;
    `options` go to `DecodeSide` (a shorter `pair_timeout_s`)."""
    spec = WorkerSpec("decode", str(checkpoint), "mirror", LOOPBACK, "", kv_pages=64)
    config = engine_config(spec, loaded)
    transport = get_transport("tcp", host="127.0.0.1")
    pool = transport.create_pool(loaded.config.kv_geometry(config.page_size), config.decode_pages)
    receiver = transport.receiver(pool)
    engine = DecodeEngine(loaded.model, pool, config, FaultSet(), inbound=receiver)
    return DecodeSide(engine, receiver, LOOPBACK, FaultSet(), **options)


@contextmanager
def side_pair(
    checkpoint: Path,
    prefill_model: Callable[[CausalLM], CausalLM] = lambda model: model,
    prefill_options: dict[str, Any] | None = None,
    decode_options: dict[str, Any] | None = None,
) -> Iterator[tuple[PrefillSide, DecodeSide]]:
    """A started prefill side and decode side in this process, paired over loopback (TCP KV,
    the bootstrap channel); prefill's model is `prefill_model` of the mirror model."""
    loaded = load_model(str(checkpoint), kind="mirror")
    spec = WorkerSpec("prefill", str(checkpoint), "mirror", LOOPBACK, "", kv_pages=64)
    config = engine_config(spec, loaded)
    pool = KVPool(loaded.config.kv_geometry(config.page_size), config.prefill_pages)
    engine = PrefillEngine(prefill_model(loaded.model), pool, config, FaultSet())
    prefill = PrefillSide(engine, get_transport("tcp"), LOOPBACK, **(prefill_options or {}))
    decode = decode_side(checkpoint, loaded, **(decode_options or {}))
    prefill.start()
    decode.start()
    try:
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def room_work(peer: str) -> GenerateWork:
    """One paired room's work: a 32-token prompt for 4 tokens, its prefill half at `peer`."""
    return GenerateWork(
        room="room-1",
        tenant="tenant-a",
        prompt_ids=tuple(range(20, 52)),
        sampling=SamplingParams(max_tokens=4),
        cache_namespace="tenant-a",
        peer=peer,
    )
