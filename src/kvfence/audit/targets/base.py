"""The target-adapter contract: how the audit reads facts from one live engine.

An adapter (`Target` subclass, one module per engine, listed in
`targets.registry`) knows which endpoints its engine exposes and turns them
into `TargetFacts`: every field a `Fact` with the endpoint and field it came
from, or explicitly unknown with a note saying why. Adapters never guess a
number they cannot read; where an engine's HTTP surface is ambiguous (the
llama.cpp slot pool) they report the bound they can prove and say so.

Contract:
- `read_facts(client)` reads the facts (a few GETs, all charged to the
  budget). `facts(client)` caches them per target for the whole audit.
- `read_counters(client)` reads the engine's isolation / transfer failure
  counters *now* (for before/after snapshots); {} when the engine has none.
- `identify(endpoints)` (classmethod) returns a human-readable reason when
  the responses prove this engine, else None (`--engine auto`).
- Adapters set `client.model` for generation requests via `configure_client`.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client.parser import text_string_to_metric_families

from kvfence.audit.base import Fact, JSONValue
from kvfence.audit.client import ProbeClient, ProbeResponse

# TargetFacts.extra key: the pool may be shared between slots (llama.cpp's automatic
# slots), so `pool_tokens` is the most one request can hold, not what it is sure to get.
SHARED_POOL_KEY = "pool_may_be_shared"
# TargetFacts.extra / NodeFacts.extra key: tokens `pool_tokens` counts that no request can
# use (vLLM's null block, block 0 of every pool), so the usable pool is the difference.
RESERVED_KEY = "pool_reserved_tokens"


@dataclass(slots=True)
class NodeFacts:
    """One worker of a fleet behind a router, with where each fact came from.

    - `role`: "prefill" | "decode" | "unified" (serves whole requests) or unknown;
    - `pool_tokens`: its KV pool (smallest rank's) — gated when it prefills;
    - `context_length`, `max_input`: its own limits; `counters`: its failure counters;
    - `reached`: whether the node answered directly (else facts came via the router).
    """

    url: str
    role: Fact
    pool_tokens: Fact
    context_length: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    max_input: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    counters: dict[str, Fact] = field(default_factory=dict)
    extra: dict[str, Fact] = field(default_factory=dict)
    reached: bool = False
    # Where the audit reaches the node: the router's URL for it, whose path can be the
    # router's credential (/r/<secret>). Never shown: `url` is its origin.
    endpoint: str = field(default="", repr=False)

    @property
    def prefills(self) -> bool:
        """Whether prompts are written into this node's pool (unknown or mixed: fail closed)."""
        return self.role.value != "decode"

    def to_json(self) -> dict[str, JSONValue]:
        out: dict[str, JSONValue] = {
            "url": self.url,
            "reached": self.reached,
            "role": self.role.to_json(),
            "pool_tokens": self.pool_tokens.to_json(),
            "context_length": self.context_length.to_json(),
            "max_input": self.max_input.to_json(),
        }
        out["counters"] = {k: v.to_json() for k, v in self.counters.items()}
        out["extra"] = {k: v.to_json() for k, v in self.extra.items()}
        return out


@dataclass(slots=True)
class TargetFacts:
    """What the checks need to know about one target; each a `Fact` (maybe unknown).

    - `pool_tokens`: KV tokens the engine can hold for prompts (the prefill
      pool on a PD prefill node) — the number the capacity gate compares.
    - `context_length`: the model context the server advertises.
    - `max_input`: the longest prompt (in tokens) the server says it accepts
      with max_tokens=1 — each adapter translates its engine's own rule
      (prompt + max_tokens <= max_model_len, prompt < n_ctx, …) into this.
    - `page_size`: KV page / block size in tokens.
    - `prefix_caching`: bool; `cache_salt_supported`: bool.
    - `tokenizer`: "/tokenize" when the server tokenizes for us, else
      "calibrated from usage.prompt_tokens".
    - `model`: the model id to send in requests.
    - `counters`: isolation / transfer / outcome counters at read time.
    - `extra`: anything else worth showing (disaggregation mode, lab profile…);
      `extra["pd_role"]` is the node's live P/D role where the engine says it.
    - `nodes`: for a fleet behind a router, one `NodeFacts` per worker (the
      capacity gate then gates every prefill node; empty for one engine).
    """

    engine: Fact
    model: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    pool_tokens: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    context_length: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    max_input: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    page_size: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    prefix_caching: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    cache_salt_supported: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    tokenizer: Fact = field(default_factory=lambda: Fact.unknown("not read"))
    counters: dict[str, Fact] = field(default_factory=dict)
    extra: dict[str, Fact] = field(default_factory=dict)
    nodes: list[NodeFacts] = field(default_factory=list)
    # Token ids the model accepts: [0, vocab_size). Probes draw their ids below it.
    vocab_size: Fact = field(default_factory=lambda: Fact.unknown("not stated by the engine"))

    def input_limit(self, context_override: int | None = None) -> Fact:
        """The longest accepted prompt: the override, else max_input, else context_length."""
        if context_override is not None:
            return Fact(context_override, "--context (operator override)")
        if self.max_input.known:
            return self.max_input
        return self.context_length

    def to_json(self) -> dict[str, JSONValue]:
        out: dict[str, JSONValue] = {
            name: getattr(self, name).to_json()
            for name in (
                "engine",
                "model",
                "pool_tokens",
                "context_length",
                "max_input",
                "page_size",
                "prefix_caching",
                "cache_salt_supported",
                "tokenizer",
                "vocab_size",
            )
        }
        out["counters"] = {k: v.to_json() for k, v in self.counters.items()}
        out["extra"] = {k: v.to_json() for k, v in self.extra.items()}
        if self.nodes:
            # Flat "url fact" keys: a report renders them as rows like any other fact.
            out["nodes"] = {
                f"{n.url} {name}": getattr(n, name).to_json()
                for n in self.nodes
                for name in ("role", "pool_tokens", "context_length")
            }
        return out


class Endpoints:
    """Memoised GETs against one target, shared by detection and fact reading."""

    def __init__(self, client: ProbeClient) -> None:
        self.client = client
        self._seen: dict[str, ProbeResponse] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> ProbeResponse:
        with self._lock:
            if path not in self._seen:
                self._seen[path] = self.client.get(path, timeout_s=30.0)
            return self._seen[path]

    def seen(self) -> dict[str, ProbeResponse]:
        """Every response fetched so far, by path."""
        with self._lock:
            return dict(self._seen)

    def json(self, path: str) -> dict[str, Any] | None:
        """The JSON object at `path` when it answered 200 with one, else None."""
        r = self.get(path)
        return r.json if r.ok and isinstance(r.json, dict) else None

    def metrics(self, path: str = "/metrics") -> list[Sample] | None:
        r = self.get(path)
        if not r.ok:
            return None
        return parse_prometheus(r.body)


# -- Prometheus text exposition, read with prometheus_client's own parser ----------


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, label values unescaped (`\\"`, `\\\\`,
    `\\n` as the format defines them).

    The standard parser stops at the first line it cannot read; a target's other samples are
    still worth reading, so the text is then read line by line and only the lines it cannot
    read are left out (a sample's name and labels do not depend on its family's comments).
    """
    try:
        return _samples(text)
    except ValueError:
        out: list[Sample] = []
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    out.extend(_samples(line))
                except ValueError:
                    continue  # not a sample: the rest of the text still counts
        return out


def _samples(text: str) -> list[Sample]:
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def samples_named(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]


def unanswered(ep: Endpoints, path: str) -> str:
    """Why `path` gave nothing to read, naming the option that fixes a refused credential."""
    r = ep.get(path)
    if r.status in (401, 403):
        fix = (
            "the --operator-key given was refused"
            if ep.client.operator_key
            else "pass --operator-key (or set KVFENCE_AUDIT_OPERATOR_KEY)"
        )
        return f"GET {path} answered {r.status}: it is operator data; {fix}"
    return f"GET {path} gave nothing to read ({r.outcome()})"


def metric_sum(
    samples: list[Sample] | None, name: str, source: str, why: str = "/metrics did not answer 200"
) -> Fact:
    """The sum of a metric's samples across label sets, or unknown (`why`: no samples at all)."""
    if samples is None:
        return Fact.unknown(source, why)
    found = samples_named(samples, name)
    if not found:
        return Fact.unknown(source, f"{name} not exposed")
    total = float(sum(s.value for s in found))
    return Fact(int(total) if total.is_integer() else total, source)


def json_int(obj: dict[str, Any] | None, *keys: str) -> tuple[int | None, str | None]:
    """The first of `keys` present in `obj` with an int value: (value, key)."""
    if obj is None:
        return None, None
    for k in keys:
        v = obj.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v, k
        if isinstance(v, float) and v.is_integer():
            return int(v), k
    return None, None


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)


class Target(ABC):
    """One live engine endpoint under audit. Subclasses: one per engine."""

    engine: ClassVar[str] = ""

    def __init__(self, url: str, detected_by: str = "--engine given on the command line") -> None:
        self.url = url.rstrip("/")
        self.detected_by = detected_by
        self._facts: TargetFacts | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @classmethod
    @abstractmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        """A reason these responses prove this engine, or None."""

    @abstractmethod
    def read_facts(self, client: ProbeClient) -> TargetFacts:
        """Read every fact from the live process, each with its source."""

    def read_counters(self, client: ProbeClient) -> dict[str, Fact]:
        """Isolation/transfer failure counters now; {} when the engine exposes none."""
        return {}

    def facts(self, client: ProbeClient) -> TargetFacts:
        """Facts read once per audit (then cached); also sets `client.model`."""
        with self._lock:
            if self._facts is None:
                self._facts = self.read_facts(client)
            facts = self._facts
        self.configure_client(client)
        return facts

    def configure_client(self, client: ProbeClient) -> None:
        """Make `client` send the model id this target serves."""
        if self._facts is not None and isinstance(self._facts.model.value, str):
            client.model = self._facts.model.value


def models_fact(ep: Endpoints) -> tuple[Fact, dict[str, Any] | None]:
    """(model id fact, first /v1/models entry) from GET /v1/models."""
    j = ep.json("/v1/models")
    data = j.get("data") if j else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        mid = data[0].get("id")
        if isinstance(mid, str):
            return Fact(mid, "GET /v1/models data[0].id"), data[0]
        return Fact.unknown("GET /v1/models", "data[0] has no id"), data[0]
    return Fact.unknown("GET /v1/models", "no model list"), None


def tokenizer_fact(client: ProbeClient) -> Fact:
    """Whether the server tokenizes for us (POST /tokenize) — one or two requests."""
    toks = client.tokenize("hello world")
    if toks:
        return Fact("/tokenize", "POST /tokenize", f"'hello world' -> {len(toks)} tokens")
    return Fact(
        "calibrated from usage.prompt_tokens",
        "POST /tokenize",
        "no /tokenize; prompt lengths are calibrated from usage.prompt_tokens",
    )
