"""OpenAI-compatible request parsing and validation, and the response shapes.

Every field a client sends is either honoured or rejected with an HTTP 400 that
names it (DESIGN.md, Conventions): unknown fields are refused, and fields we
know but do not implement (`n`, `best_of`, `echo`, `suffix`, penalties,
`logit_bias`, tools ...) are accepted only at their neutral value. Parsing
never touches the backend; a request that fails here allocates nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 2.0
SEED_RANGE = (0, 2**63 - 1)

# Known OpenAI / vLLM fields we do not implement: allowed only at their neutral value.
_NEUTRAL: dict[str, object] = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "suffix": "",
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "response_format": None,
    "parallel_tool_calls": None,
}
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


class ApiError(Exception):
    """An OpenAI-style error: the status and body the client receives."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


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


# ---- the body --------------------------------------------------------------------------


def load_json(raw: bytes) -> dict[str, Any]:
    """Strict UTF-8, strict JSON (no NaN/Infinity), an object at the top."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"request body is not valid UTF-8 (byte {e.start})", None, "invalid_utf8"
        ) from None
    if not text.strip():
        raise bad_request("request body is empty; send a JSON object", None, "invalid_json")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(
            f"request body is not valid JSON: {type(e).__name__}: {e}", None, "invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object", None, "invalid_json")
    return obj


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


# ---- field readers ----------------------------------------------------------------------


def _int(
    obj: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int | None
) -> int | None:
    value = obj.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"`{name}` must be an integer, got {json.dumps(value)}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad_request(f"`{name}` must be {bound}, got {value}", name)
    return value


def _number(obj: Mapping[str, Any], name: str, default: float) -> float:
    value = obj.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"`{name}` must be a number, got {json.dumps(value)}", name)
    return float(value)


def _bool(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"`{name}` must be true or false, got {json.dumps(value)}", name)
    return value


def _is_neutral(name: str, value: object) -> bool:
    neutral = _NEUTRAL[name]
    if value is None:
        return True
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral  # `n: true` is not `n: 1`
    return value == neutral


def _check_fields(obj: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for name, value in obj.items():
        if name in allowed:
            continue
        if name in _NEUTRAL:
            if _is_neutral(name, value):
                continue
            raise bad_request(
                f"`{name}` = {json.dumps(value)} is not supported by this server "
                f"(only {json.dumps(_NEUTRAL[name])} or null)",
                name,
                "unsupported_parameter",
            )
        raise bad_request(
            f"unknown field `{name}`; this server rejects fields it would otherwise ignore",
            name,
            "unknown_parameter",
        )


def _stop(obj: Mapping[str, Any]) -> tuple[str, ...]:
    value = obj.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("`stop` must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(
            f"`stop` has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad_request(
                f"each `stop` string must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}",
                "stop",
            )
    return tuple(items)


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise bad_request(f"`{name}` must be a list of integer token ids", name)
    return tuple(value)


def _stream_options(obj: Mapping[str, Any], stream: bool) -> bool:
    value = obj.get("stream_options")
    if value is None:
        return False
    if not stream:
        raise bad_request(
            "`stream_options` is only allowed when `stream` is true", "stream_options"
        )
    if not isinstance(value, dict):
        raise bad_request("`stream_options` must be an object", "stream_options")
    unknown = set(value) - {"include_usage"}
    if unknown:
        name = sorted(unknown)[0]
        raise bad_request(
            f"unknown field `stream_options.{name}`",
            f"stream_options.{name}",
            "unknown_parameter",
        )
    return _bool(value, "include_usage", False)


def _cache_salt(obj: Mapping[str, Any]) -> str | None:
    value = obj.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request("`cache_salt` must be a non-empty string", "cache_salt")
    return value


def _model(obj: Mapping[str, Any]) -> str | None:
    value = obj.get("model")
    if value is not None and not isinstance(value, str):
        raise bad_request("`model` must be a string", "model")
    return value


def _sampling_common(obj: Mapping[str, Any]) -> dict[str, Any]:
    temperature = _number(obj, "temperature", 1.0)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(
            f"`temperature` must be in [0, {MAX_TEMPERATURE:g}], got {temperature:g}",
            "temperature",
        )
    top_p = _number(obj, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"`top_p` must be in (0, 1], got {top_p:g}", "top_p")
    top_k = _int(obj, "top_k", 0, -1, None)
    assert top_k is not None
    stream = _bool(obj, "stream", False)
    stop_ids = obj.get("stop_token_ids")
    return {
        "model": _model(obj),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": max(top_k, 0),  # vLLM spells "off" as -1
        "seed": _int(obj, "seed", None, *SEED_RANGE),
        "stop": _stop(obj),
        "stop_token_ids": () if stop_ids is None else _token_ids(stop_ids, "stop_token_ids"),
        "ignore_eos": _bool(obj, "ignore_eos", False),
        "stream": stream,
        "include_usage": _stream_options(obj, stream),
        "cache_salt": _cache_salt(obj),
    }


# ---- the two endpoints ------------------------------------------------------------------


def parse_completion(obj: Mapping[str, Any]) -> GenerationRequest:
    _check_fields(obj, COMPLETION_FIELDS)
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
    logprobs = _int(obj, "logprobs", None, 0, MAX_LOGPROBS)
    return GenerationRequest(
        kind="completion",
        prompt=parsed,
        max_tokens=_int(obj, "max_tokens", None, 1, None),
        logprobs=logprobs,
        **_sampling_common(obj),
    )


def parse_chat(obj: Mapping[str, Any]) -> GenerationRequest:
    _check_fields(obj, CHAT_FIELDS)
    messages = _messages(obj.get("messages"))
    max_tokens = _int(obj, "max_tokens", None, 1, None)
    max_completion = _int(obj, "max_completion_tokens", None, 1, None)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_request(
            "`max_tokens` and `max_completion_tokens` disagree; send one of them",
            "max_completion_tokens",
        )
    want_logprobs = _bool(obj, "logprobs", False)
    top = _int(obj, "top_logprobs", None, 0, MAX_LOGPROBS)
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
    _check_fields(obj, frozenset({"model", "prompt", "messages", "add_special_tokens"}))
    _model(obj)
    if _bool(obj, "add_special_tokens", False):
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
    _check_fields(obj, frozenset({"model", "tokens"}))
    _model(obj)
    if "tokens" not in obj:
        raise bad_request("`tokens` is required", "tokens", "missing_required_parameter")
    return _token_ids(obj["tokens"], "tokens")


# ---- responses --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token: its text, logprob and the top alternatives (text, logprob)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(entries: Sequence[TokenLogprob], text_start: int) -> dict[str, Any]:
    offsets, pos = [], text_start
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }
