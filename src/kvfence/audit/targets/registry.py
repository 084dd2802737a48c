"""The adapter registry and `--engine auto` detection.

Detection asks the most specific engines first (kvfence, the routers
sglang-router and vllm-router, SGLang, llama.cpp, TGI, vLLM) and falls back to the generic OpenAI adapter; it always says how
it identified the engine. It uses the same bounded client, so its GETs count
against the budget like every other request.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvfence.audit.client import ProbeClient
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
    statuses = {p: r.status if r.answered else r.error for p, r in ep.seen().items()}
    raise DetectionError(f"no adapter recognised {url} (tried {', '.join(tried)}; saw {statuses})")


def make_target(url: str, engine: str, client: ProbeClient) -> Target:
    """The adapter for `engine` ("auto" detects it)."""
    if engine == "auto":
        return detect(url, client)
    try:
        return ADAPTERS[engine](url)
    except KeyError:
        raise ValueError(
            f"unknown engine {engine!r}; choose from {', '.join(ENGINE_CHOICES)}"
        ) from None
