"""OpenAI-compatible request parsing and validation (the shapes of answers: responses.py).

Every field a client sends is either honoured or rejected with an HTTP 400 that
names it (docs/ARCHITECTURE.md, Conventions): unknown fields are refused, and fields we
know but do not implement (`n`, `best_of`, `echo`, `suffix`, penalties,
`logit_bias`, tools ...) are accepted only at their neutral value. Parsing
never touches the backend; a request that fails here allocates nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvfence.serve.errors import bad_request
from kvfence.serve.fields import (
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    SEED_RANGE,
    boolean,
    cache_salt,
    check_fields,
    integer,
    model_name,
    number,
    stop_strings,
    stream_options,
    token_ids,
)

# top_k's edge limit: the engine's own (engine/messages.py; a test keeps the two equal).
# Above any vocabulary, so every value the sampler can run is accepted and means "off"
# beyond the vocab size; what lies above it (e.g. 2**63) is a 400 here, never a step error.
MAX_TOP_K = 2**31 - 1

_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "stream",
        "stream_options",
        "cache_salt",
    }
)
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
CHAT_ROLES = ("system", "developer", "user", "assistant")

Kind = Literal["completion", "chat"]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request, before tokenization. `max_tokens` None = the server default."""

    kind: Kind
    model: str | None
    prompt: str | tuple[int, ...] | tuple[ChatMessage, ...]
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None  # top alternatives per token; None = logprobs off
    stream: bool
    include_usage: bool
    cache_salt: str | None


def _sampling_common(obj: Mapping[str, Any]) -> dict[str, Any]:
    temperature = number(obj, "temperature", 1.0)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(
            f"`temperature` must be in [0, {MAX_TEMPERATURE:g}], got {temperature:g}",
            "temperature",
        )
    top_p = number(obj, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"`top_p` must be in (0, 1], got {top_p:g}", "top_p")
    # Bounded here, not only in the engine: a value torch cannot hold is a 400 naming the
    # field and its limit, never an error inside a step shared with other tenants.
    top_k = integer(obj, "top_k", 0, -1, MAX_TOP_K)
    assert top_k is not None
    stream = boolean(obj, "stream", False)
    stop_ids = obj.get("stop_token_ids")
    return {
        "model": model_name(obj),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": max(top_k, 0),  # vLLM spells "off" as -1
        "seed": integer(obj, "seed", None, *SEED_RANGE),
        "stop": stop_strings(obj),
        "stop_token_ids": () if stop_ids is None else token_ids(stop_ids, "stop_token_ids"),
        "ignore_eos": boolean(obj, "ignore_eos", False),
        "stream": stream,
        "include_usage": stream_options(obj, stream),
        "cache_salt": cache_salt(obj),
    }


# ---- the two endpoints ------------------------------------------------------------------


def parse_completion(obj: Mapping[str, Any]) -> GenerationRequest:
    check_fields(obj, COMPLETION_FIELDS)
    prompt = obj.get("prompt")
    parsed: str | tuple[int, ...]
    if isinstance(prompt, str):
        parsed = prompt
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        parsed = tuple(prompt)
    elif isinstance(prompt, list):
        raise bad_request(
            "`prompt` must be a string or one list of token ids; batched prompts are not "
            "supported (send one request per prompt)",
            "prompt",
            "unsupported_parameter",
        )
    elif prompt is None:
        raise bad_request("`prompt` is required", "prompt", "missing_required_parameter")
    else:
        raise bad_request("`prompt` must be a string or a list of token ids", "prompt")
    if len(parsed) == 0:
        raise bad_request("`prompt` is empty; send at least one token", "prompt", "empty_prompt")
    logprobs = integer(obj, "logprobs", None, 0, MAX_LOGPROBS)
    return GenerationRequest(
        kind="completion",
        prompt=parsed,
        max_tokens=integer(obj, "max_tokens", None, 1, None),
        logprobs=logprobs,
        **_sampling_common(obj),
    )


def parse_chat(obj: Mapping[str, Any]) -> GenerationRequest:
    check_fields(obj, CHAT_FIELDS)
    messages = _messages(obj.get("messages"))
    max_tokens = integer(obj, "max_tokens", None, 1, None)
    max_completion = integer(obj, "max_completion_tokens", None, 1, None)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_request(
            "`max_tokens` and `max_completion_tokens` disagree; send one of them",
            "max_completion_tokens",
        )
    want_logprobs = boolean(obj, "logprobs", False)
    top = integer(obj, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad_request("`top_logprobs` requires `logprobs: true`", "top_logprobs")
    return GenerationRequest(
        kind="chat",
        prompt=messages,
        max_tokens=max_tokens if max_tokens is not None else max_completion,
        logprobs=(top or 0) if want_logprobs else None,
        **_sampling_common(obj),
    )


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if value is None:
        raise bad_request("`messages` is required", "messages", "missing_required_parameter")
    if not isinstance(value, list):
        raise bad_request("`messages` must be a list of message objects", "messages")
    if not value:
        raise bad_request("`messages` is empty; send at least one", "messages", "empty_prompt")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"`{where}` must be an object", where)
        unknown = set(m) - {"role", "content"}
        if unknown:
            name = sorted(unknown)[0]
            raise bad_request(
                f"`{where}.{name}` is not supported (messages carry only role and content)",
                f"{where}.{name}",
                "unsupported_parameter",
            )
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"`{where}.role` must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}",
                f"{where}.role",
            )
        out.append(ChatMessage(role=role, content=_content(m.get("content"), where)))
    return tuple(out)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or set(part) != {"type", "text"}
                or not isinstance(part["text"], str)
            ):
                raise bad_request(
                    f"`{where}.content[{j}]` must be {{'type': 'text', 'text': str}}; "
                    "only text content is supported",
                    f"{where}.content",
                    "unsupported_parameter",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"`{where}.content` must be a string or a list of text parts", where)


def parse_tokenize(obj: Mapping[str, Any]) -> tuple[str | None, tuple[ChatMessage, ...] | None]:
    """vLLM's /tokenize: `prompt` (a string) or `messages`; returns exactly one of them."""
    check_fields(obj, frozenset({"model", "prompt", "messages", "add_special_tokens"}))
    model_name(obj)
    if boolean(obj, "add_special_tokens", False):
        raise bad_request(
            "`add_special_tokens: true` is not supported; prompts are encoded as their text",
            "add_special_tokens",
            "unsupported_parameter",
        )
    if ("prompt" in obj) == ("messages" in obj):
        raise bad_request("send exactly one of `prompt` or `messages`", "prompt")
    if "messages" in obj:
        return None, _messages(obj["messages"])
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise bad_request("`prompt` must be a string", "prompt")
    return prompt, None


def parse_detokenize(obj: Mapping[str, Any]) -> tuple[int, ...]:
    check_fields(obj, frozenset({"model", "tokens"}))
    model_name(obj)
    if "tokens" not in obj:
        raise bad_request("`tokens` is required", "tokens", "missing_required_parameter")
    return token_ids(obj["tokens"], "tokens")
