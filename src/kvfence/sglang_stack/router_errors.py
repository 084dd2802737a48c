"""sglang-router's own refusals, as kvfence's error envelope (the edge's answers, edge.py).

A client of the stack gets one error shape from every route: `{"error": {"message",
"type", "param", "code"}}`, with `param` naming the field at fault where the message
names one. sglang-router 0.3.2 answers in other shapes (all seen live): its JSON reader's
422 in plain text; its own checks as `{"error": {"code": 400, ...}}`; a worker's error
rewritten with the field dropped and `"type": "Bad Request"`; and a worker's refusal of a
stream as one event that is not JSON, the worker's envelope inside it cut short.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvfence.serve.errors import ApiError

_JSON_FIELD = re.compile(r'"(\w+)":("(?:[^"\\]|\\.)*"|null)')
# "missing field `model`", or "prompt: data did not match any variant ..." (seen live)
_ROUTER_FIELD = re.compile(r"field `(\w+)`|target type: (\w+): ")
# The router's own refusals of what a kvfence worker would take, by their words (seen live):
# their code here is the one the stack's schema lists (openapi.BEYOND_SCHEMA).
# A worker's refusal reaches the client with the router's code in place of the worker's
# (`decode_bad_request`, seen live): the worker's own is read back from its words.
_ROUTER_CODES = (
    ("cannot be empty", "empty_content"),  # a message's content, or its list of parts
    ("maximum context length is", "context_length_exceeded"),
    ("is smaller than the context", "pool_capacity_exceeded"),  # before the general limit
    ("tokens per request (max_req_input_len)", "context_length_exceeded"),
)
_ROUTER_MADE = re.compile(r"(decode|prefill)_")
# A worker's messages say `prompt` and `max_tokens`; a chat body names them otherwise.
_CHAT_WORDS = (("prompt", "messages"), ("max_tokens", "max_completion_tokens"))


def unreadable(content: bytes) -> ApiError:
    """The router's 422 (its JSON types could not take a body kvfence's parser took) as a 400."""
    text = content.decode("utf-8", "replace")[:300]
    named = _ROUTER_FIELD.search(text)
    return ApiError(
        400,
        f"sglang-router could not read this body: {text}",
        param=named.group(1) or named.group(2) if named else None,
        code="invalid_value" if named else "invalid_json",
    )


def conform(status: int, content: bytes, fields: Sequence[str]) -> dict[str, Any] | None:
    """None when the router's error answer is kvfence's envelope already; else one that is.

    The router writes its own refusals (`{"error": {"code": 400, ...}}` for a chat message it
    will not take) and rewrites a worker's (`"type": "Bad Request"`, the field dropped), seen
    live; a client gets one shape from every route, with the field named where it can be.
    """
    try:
        obj = json.loads(content)
    except ValueError:
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    err = err if isinstance(err, dict) else {}
    if isinstance(obj, dict) and set(obj) == {"error"} and _kvfence_shaped(err):
        return None
    message = err.get("message")
    if not isinstance(message, str) or not message:
        text = content.decode("utf-8", "replace")[:300].strip()
        message = text or f"the router answered {status}"
    code = err.get("code")
    kept = code if isinstance(code, str) else None
    if kept is None or _ROUTER_MADE.match(kept):
        code = next((c for words, c in _ROUTER_CODES if words in message), kept)
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": named_field(message, fields),
            "code": code,
        }
    }


def _kvfence_shaped(err: Mapping[str, Any]) -> bool:
    return (
        isinstance(err.get("message"), str)
        and bool(err["message"])
        and isinstance(err.get("type"), str)
        and "param" in err
        and (err["param"] is None or isinstance(err["param"], str))
        and (err.get("code") is None or isinstance(err.get("code"), str))
    )


def named_field(message: str, fields: Sequence[str]) -> str | None:
    """The field a message names: `in backticks`, `name: ...` first, else the body's first."""
    quoted = re.search(r"`([\w.]+)`", message)
    if quoted:
        return quoted.group(1)
    lead = re.match(r"(\w+): ", message)
    if lead and lead.group(1) in fields:
        return lead.group(1)
    words = {**{f: f for f in fields}, **{w: f for w, f in _CHAT_WORDS if f in fields}}
    found = [
        (m.start(), f)
        for w, f in words.items()
        if (m := re.search(rf"\b{re.escape(w)}\b", message))
    ]
    return min(found)[1] if found else None


def refusal(content: bytes) -> dict[str, Any]:
    """The worker's error inside the router's refusal of a stream, as an error envelope.

    sglang-router 0.3.2 answers a worker's 4xx to a streamed request with the worker's
    status and one event that is not JSON: `data: {'error': {"message":` and the worker's
    own envelope, cut short (seen live). The worker's fields that arrived whole are kept.
    """
    text = content.decode("utf-8", "replace")
    start = text.find('{"error":{')
    fields: dict[str, Any] = {}
    if start >= 0:
        for name, raw in _JSON_FIELD.findall(text, start):
            if name in ("message", "type", "param", "code") and name not in fields:
                fields[name] = json.loads(raw)
    if "message" not in fields:
        return ApiError(502, "the router refused the request without saying why").body()
    shape = {"message": "", "type": "invalid_request_error", "param": None, "code": None}
    return {"error": shape | fields}
