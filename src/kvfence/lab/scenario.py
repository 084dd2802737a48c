"""The incident scenario, run against a real kvfence server over loopback HTTP.

1. Tenant A sends long prompts carrying a unique sentinel; they finish, and
   their decode pages go back to the pool (contents not zeroed: scrub none).
2. Tenant B sends one prompt longer than the prefill pool but shorter than the
   advertised context: exactly where the Workers AI reject path fired.
3. We read B's answer as a client would: status, body, `usage.prompt_tokens`,
   and whether A's sentinel (verbatim, or as a 4-token fragment) is in it.

Outcomes: LEAK (HTTP 200 and A's data in B's body), CLEAN_ERROR (an error
status with an error body, nothing of A's), or UNEXPECTED (anything else, e.g.
200 with no leak: the reject path lost the request's error, which I6 forbids).
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvfence.faults import Fault, FaultSet
from kvfence.lab.profiles import Scale
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, build_local
from kvfence.serve.pool_sizing import PoolSizes
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

TENANT_A, TENANT_B = "tenant-a", "tenant-b"
OPERATOR = "operator"  # the key in `LabServer.keys` that reads operator data
DEFAULT_SCALE = Scale()
FRAGMENT_TOKENS = 4  # a run of this many of a sentinel's tokens in B's body counts as a leak
SENTINEL_PREFIX = "ZQX"
SENTINEL_LETTERS = 7  # random capitals after the prefix: 26**7 sentinels, none made of digits


class Outcome(enum.Enum):
    LEAK = "leak"
    CLEAN_ERROR = "clean error"
    UNEXPECTED = "unexpected"


@dataclass(frozen=True, slots=True)
class Exchange:
    """One request as the client saw it."""

    tenant: str
    prompt_tokens: int
    status: int
    body: dict[str, Any]
    text: str  # the completion text, or the error message

    @property
    def reported_prompt_tokens(self) -> int | None:
        usage = self.body.get("usage")
        return int(usage["prompt_tokens"]) if isinstance(usage, dict) else None


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    faults: FaultSet
    model_kind: str
    sentinel: str
    a: tuple[Exchange, ...]
    b: Exchange
    leaked_fragment: str | None  # the piece of A's data found in B's body, if any
    server_info: dict[str, Any] = field(default_factory=dict)

    @property
    def outcome(self) -> Outcome:
        if self.b.status == 200 and self.leaked_fragment is not None:
            return Outcome.LEAK
        if self.b.status >= 400 and "error" in self.b.body and self.leaked_fragment is None:
            return Outcome.CLEAN_ERROR
        return Outcome.UNEXPECTED


@dataclass(frozen=True, slots=True)
class LabServer:
    url: str
    model: str
    keys: dict[str, str]
    tokenizer: Tokenizer
    info: Callable[[], dict[str, Any]]
    text_prompts: bool = False  # send prompts as text (a router that refuses token ids)


class ServerFactory(Protocol):
    """Starts a lab server (one topology) with these switches; `lab_server` is the default."""

    def __call__(
        self,
        checkpoint: Path,
        faults: FaultSet,
        *,
        model_kind: str = ...,
        scale: Scale = ...,
        profile: str | None = ...,
    ) -> AbstractContextManager[LabServer]: ...


@contextmanager
def lab_server(
    checkpoint: Path,
    faults: FaultSet,
    *,
    model_kind: str = "mirror",
    scale: Scale = DEFAULT_SCALE,
    profile: str | None = None,
) -> Iterator[LabServer]:
    """A kvfence server with the incident's scaled pools and these switches.

    With the `undersized-pool` switch off the pool is still undersized (that is
    the scenario), so the server runs in the honest `allow_undersized_pool`
    mode: the edge rejects prompt + max_tokens > pool with HTTP 400 (I4).
    """
    spec = LocalSpec(
        checkpoint,
        kind=model_kind,
        context_length=scale.context_length,
        pools=PoolSizes(prefill_pages=scale.prefill_pages, decode_pages=scale.decode_pages),
        page_size=scale.page_size,
        faults=faults,
        allow_undersized_pool=Fault.UNDERSIZED_POOL not in faults,
        lab_profile=profile,
        prefix_cache=False,
    )
    parts = build_local(spec)
    tenants = TenantRegistry.generate((TENANT_A, TENANT_B))
    keys = {t.name: t.keys[0] for t in tenants.tenants}
    keys[OPERATOR] = tenants.operator_keys[0]  # /metrics and the lab facts are operator data
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    parts.pipeline.start()
    try:
        with ServerThread(app) as srv:

            def info() -> dict[str, Any]:
                r = httpx.get(f"{srv.url}/server_info", headers=_auth(keys[OPERATOR]), timeout=30)
                return dict(r.json())

            yield LabServer(srv.url, parts.config.model_name, keys, parts.loaded.tokenizer, info)
    finally:
        parts.pipeline.stop()


def run_incident(
    checkpoint: Path,
    faults: FaultSet,
    *,
    model_kind: str = "mirror",
    scale: Scale = DEFAULT_SCALE,
    seed: int | None = None,
    a_topic: str = "invoice",
    profile: str | None = None,
    server: ServerFactory = lab_server,
) -> ScenarioResult:
    """A's sentinel-carrying traffic, then B's over-long prompt; B's answer read as a client would."""
    rng = secrets.SystemRandom() if seed is None else _Seeded(seed)
    sentinel = make_sentinel(rng)
    with server(checkpoint, faults, model_kind=model_kind, scale=scale, profile=profile) as srv:
        a_len = int(scale.prefill_pool_tokens * 0.8)  # fits the pool: A is served normally
        b_len = (scale.prefill_pool_tokens + scale.context_length) // 2  # > pool, < context
        a_prompt = _prompt_of(srv.tokenizer, f"{sentinel} {a_topic} ", a_len)
        b_prompt = _prompt_of(srv.tokenizer, "weather report ", b_len)
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            a = tuple(_complete(client, srv, TENANT_A, a_prompt, max_tokens=8) for _ in range(2))
            b = _complete(client, srv, TENANT_B, b_prompt, max_tokens=scale.page_size * 4)
        info = srv.info()
    fragment = find_leak(b, sentinel, srv.tokenizer)
    return ScenarioResult(faults, model_kind, sentinel, a, b, fragment, info)


def make_sentinel(rng: _Rng) -> str:
    """Tenant A's secret: the prefix and random capitals (e.g. ZQXKWHTRPB).

    Capitals, not digits: an error body carries the engine's own decimal ids
    (sequence ids, generations, counts), and a 4-digit run of a numeric
    sentinel turns up in one of them by chance, a leak that never happened.
    """
    return SENTINEL_PREFIX + "".join(
        chr(ord("A") + rng.randrange(0, 26)) for _ in range(SENTINEL_LETTERS)
    )


def find_leak(b: Exchange, sentinel: str, tokenizer: Tokenizer) -> str | None:
    """A's sentinel in B's body: verbatim, or any run of FRAGMENT_TOKENS of its tokens.

    A run must hold a letter: digits and punctuation alone are in every body
    (ids, counts), so they prove nothing about where they came from.
    """
    body = b.text
    if sentinel in body:
        return sentinel
    ids = tokenizer.encode(sentinel)
    for i in range(len(ids) - FRAGMENT_TOKENS + 1):
        piece = tokenizer.decode(ids[i : i + FRAGMENT_TOKENS])
        if any(c.isalpha() for c in piece) and piece in body:
            return piece
    return None


def _prompt_of(tokenizer: Tokenizer, unit: str, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` token ids made of `unit` repeated (sent as ids: token-exact)."""
    ids: list[int] = []
    unit_ids = tokenizer.encode(unit)
    while len(ids) < n_tokens:
        ids.extend(unit_ids)
    return ids[:n_tokens]


def _complete(
    client: httpx.Client, srv: LabServer, tenant: str, prompt: list[int], *, max_tokens: int
) -> Exchange:
    sent: list[int] | str = prompt
    n_tokens = len(prompt)
    if srv.text_prompts:  # the ids' text; its own token count is what the engine sees
        sent = srv.tokenizer.decode(prompt)
        n_tokens = len(srv.tokenizer.encode(sent))
    r = client.post(
        "/v1/completions",
        headers=_auth(srv.keys[tenant]),
        json={
            "model": srv.model,
            "prompt": sent,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    body = r.json()
    if r.status_code == 200:
        text = "".join(c.get("text", "") for c in body.get("choices", []))
    else:
        text = str(body.get("error", {}).get("message", ""))
    return Exchange(tenant, n_tokens, r.status_code, body, text)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class _Rng(Protocol):
    def randrange(self, a: int, b: int) -> int: ...


class _Seeded:
    def __init__(self, seed: int) -> None:
        import random

        self._rng = random.Random(seed)

    def randrange(self, a: int, b: int) -> int:
        return self._rng.randrange(a, b)
