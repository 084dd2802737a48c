"""Strict readers for the fields of a JSON request body.

Each reader returns the field's value (or its default when absent or null)
or raises a 400 that names the field and the allowed range. `check_fields`
refuses unknown fields, and known-but-unimplemented ones unless they hold
their neutral value (docs/ARCHITECTURE.md, Conventions: honour a field or reject it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from kvfence.serve.errors import bad_request

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 2.0
SEED_RANGE = (0, 2**63 - 1)

# Known OpenAI / vLLM fields we do not implement: allowed only at their neutral value.
NEUTRAL: dict[str, object] = {
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
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_number)
    except (ValueError, RecursionError) as e:
        raise bad_request(
            f"request body is not valid JSON: {type(e).__name__}: {e}", None, "invalid_json"
        ) from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object", None, "invalid_json")
    _refuse_lone_surrogates(obj)
    return obj


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _number(literal: str) -> float | int:
    """A JSON number with a fraction or exponent; an integer when its value is one.

    JSON Schema's "integer" is a value, not a spelling: `258.0` and `2.58e2` are the
    integer 258, so the fields the schema calls integer accept them. Non-integral values
    stay floats (and are refused where an integer is needed); overflow to infinity stays a
    float too, so `number` refuses it.
    """
    value = float(literal)
    return int(value) if value.is_integer() else value


def _refuse_lone_surrogates(obj: dict[str, Any]) -> None:
    """A 400 naming the field for a string (key or value) holding a lone UTF-16 surrogate.

    JSON's `\ud800` escape decodes to a code point that has no UTF-8 form, so any later
    encode (tokenizing, hashing a cache salt, writing a log line) would raise. The walk is
    iterative: the parser already bounds the depth, and no recursion limit is touched here.
    """
    stack: list[tuple[str, Any]] = [(k, v) for k, v in obj.items()]
    for key in obj:
        _check_text(key, key)
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, f"{path}.{k}")
                stack.append((f"{path}.{k}", v))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        # The path may hold the surrogate itself (a key): escaped, so the answer encodes.
        path = path.encode("utf-8", "backslashreplace").decode("utf-8")
        raise bad_request(
            f"`{path}` holds a lone UTF-16 surrogate (U+{ord(text[e.start]):04X} at character "
            f"{e.start}); strings must be valid Unicode (escape pairs only as a high-low pair)",
            path,
            "invalid_unicode",
        ) from None


def integer(
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


def number(obj: Mapping[str, Any], name: str, default: float) -> float:
    value = obj.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"`{name}` must be a number, got {json.dumps(value)}", name)
    return float(value)


def boolean(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"`{name}` must be true or false, got {json.dumps(value)}", name)
    return value


def is_neutral(name: str, value: object) -> bool:
    neutral = NEUTRAL[name]
    if value is None:
        return True
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral  # `n: true` is not `n: 1`
    return value == neutral


def check_fields(obj: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for name, value in obj.items():
        if name in allowed:
            continue
        if name in NEUTRAL:
            if is_neutral(name, value):
                continue
            raise bad_request(
                f"`{name}` = {json.dumps(value)} is not supported by this server "
                f"(only {json.dumps(NEUTRAL[name])} or null)",
                name,
                "unsupported_parameter",
            )
        raise bad_request(
            f"unknown field `{name}`; this server rejects fields it would otherwise ignore",
            name,
            "unknown_parameter",
        )


def stop_strings(obj: Mapping[str, Any]) -> tuple[str, ...]:
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


def token_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise bad_request(f"`{name}` must be a list of integer token ids", name)
    return tuple(value)


def stream_options(obj: Mapping[str, Any], stream: bool) -> bool:
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
    return boolean(value, "include_usage", False)


def cache_salt(obj: Mapping[str, Any]) -> str | None:
    value = obj.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request("`cache_salt` must be a non-empty string", "cache_salt")
    return value


def model_name(obj: Mapping[str, Any]) -> str | None:
    value = obj.get("model")
    if value is not None and not isinstance(value, str):
        raise bad_request("`model` must be a string", "model")
    return value
