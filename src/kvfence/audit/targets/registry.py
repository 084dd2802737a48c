"""The adapter registry and `--engine auto` detection.

Detection asks the most specific engines first (kvfence, the routers
sglang-router and vllm-router, SGLang, llama.cpp, TGI, vLLM) and falls back to the generic OpenAI adapter; it always says how
it identified the engine. It uses the same bounded client, so its GETs count
against the budget like every other request.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.targets.base import Endpoints, Target
from kvfence.audit.targets.kvfence import KvfenceTarget
from kvfence.audit.targets.llamacpp import LlamacppTarget
from kvfence.audit.targets.openai import OpenAITarget
from kvfence.audit.targets.routers import SglangRouterTarget, VllmRouterTarget
from kvfence.audit.targets.sglang import SglangTarget
from kvfence.audit.targets.tgi import TgiTarget
from kvfence.audit.targets.vllm import VllmTarget

# Detection order: most specific first, the generic fallback last.
# Routers before engines: a vllm-router forwards /get_server_info and /v1/models to its
# first prefill worker, so an engine adapter would take the whole fleet for that one node.
DETECTION_ORDER: tuple[type[Target], ...] = (
    KvfenceTarget,
    SglangRouterTarget,
    VllmRouterTarget,
    SglangTarget,
    LlamacppTarget,
    TgiTarget,
    VllmTarget,
    OpenAITarget,
)
ADAPTERS: Mapping[str, type[Target]] = MappingProxyType({c.engine: c for c in DETECTION_ORDER})
ENGINE_CHOICES: tuple[str, ...] = ("auto", *ADAPTERS)


class DetectionError(RuntimeError):
    """No adapter recognised the target (it may be down or not an LLM server)."""


def detect(url: str, client: ProbeClient) -> Target:
    """Identify the engine behind `url`; the returned target says how (`detected_by`)."""
    ep = Endpoints(client)
    tried: list[str] = []
    for cls in DETECTION_ORDER:
        reason = cls.identify(ep)
        if reason is not None:
            return cls(url, detected_by=f"auto: {reason}")
        tried.append(cls.engine)
    raise DetectionError(unrecognised(url, tried, ep.seen()))


def unrecognised(url: str, tried: list[str], seen: Mapping[str, ProbeResponse]) -> str:
    """One sentence on why `url` was not identified, saying what to try."""
    answered = {path: r.status for path, r in seen.items() if r.status is not None}
    if not answered:
        why = next((r.error for r in seen.values() if r.error), "no answer")
        return (
            f"nothing answered at {url} ({why}): is the engine running, and is this its base URL?"
        )
    if set(answered.values()) <= {401, 403}:
        return (
            f"{url} refused every request ({', '.join(sorted({str(s) for s in answered.values()}))}):"
            " pass the tenants' keys (--key-a, --key-b) and --operator-key"
        )
    saw = ", ".join(f"GET {path} {status}" for path, status in answered.items())
    return (
        f"no adapter recognised {url} (tried {', '.join(tried)}; it answered {saw}): "
        "name its engine with --engine"
    )


def make_target(url: str, engine: str, client: ProbeClient, known_by: str | None = None) -> Target:
    """The adapter for `engine` ("auto" detects it); `known_by` says how a given engine is
    known when not from `--engine` (the embedded default started the server itself)."""
    if engine == "auto":
        return detect(url, client)
    try:
        cls = ADAPTERS[engine]
    except KeyError:
        raise ValueError(
            f"unknown engine {engine!r}; choose from {', '.join(ENGINE_CHOICES)}"
        ) from None
    return cls(url) if known_by is None else cls(url, detected_by=known_by)
