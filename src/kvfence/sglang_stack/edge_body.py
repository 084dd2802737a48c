"""A generation body at the stack's edge: kvfence's verdict on the client's own JSON, then
the bytes the router is sent.

The router re-serialises every body through its own types before a worker sees it: a field
it drops (`rid`) or a number it narrows (a temperature of 1e308 becomes f32 infinity, then
null) would otherwise reach the worker as a different, valid request. So `check` parses the
client's own JSON strictly (a 400 naming the field), and `for_router` changes only what the
router's types would read differently from kvfence, into a request that means the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from kvfence.serve import protocol
from kvfence.serve.errors import bad_request
from kvfence.sglang_stack.fields import split_router_fields
from kvfence.sglang_stack.generate import completion_body

Route = Literal["completion", "chat", "generate"]
FLT_MIN = 1.1754943508222875e-38  # the smallest normal float32


def check(kind: Route, obj: Mapping[str, Any]) -> None:
    """kvfence's verdict on the client's own body (a 400 naming the field), before the router."""
    if kind == "chat":
        protocol.parse_chat(split_router_fields(dict(obj), "chat", False)[0])
        return
    body, _ = split_router_fields(dict(obj), "completion", False)  # `rid`, bootstrap fields
    if kind == "generate":
        completion_body(body)
        return
    protocol.parse_completion(body)
    if isinstance(body.get("prompt"), list):
        raise bad_request(
            "`prompt` must be text here: sglang-router 0.3.2 takes no token ids on "
            "/v1/completions (send them to /generate as `input_ids`)",
            "prompt",
            "unsupported_value",
        )


def for_router(kind: Route, obj: Mapping[str, Any], model: str) -> bytes | None:
    """The body to send instead of the client's bytes; None: send them as they are.

    - kvfence reads a null field as absent; the router's types refuse a null where they want
      a value (`"echo": null` is a 422, seen live), so nulls are dropped.
    - A single server takes no model to mean its own; the router refuses a completion without
      one (422) and sends a chat on as model "unknown" (404), so the served `model` is filled in.
    - top_k 0 is "off" to kvfence (as -1 is); the router's chat refuses 0, and an absent top_k
      is off on both.
    - The router carries top_p as an f32, where a top_p below f32's normal range is 0, which
      a worker refuses. Every top_p at or below the top token's probability (>= 1/vocab)
      keeps that token alone, so the smallest normal f32 asks for exactly the same sampling.
    """
    if not (
        (kind != "generate" and obj.get("model") is None)
        or None in obj.values()
        or _f32_underflow(obj.get("top_p"))
        or _top_k_off(obj.get("top_k"))
    ):
        return None
    sent = {k: v for k, v in obj.items() if v is not None and not (k == "top_k" and _top_k_off(v))}
    if kind != "generate":
        sent.setdefault("model", model)
    if _f32_underflow(sent.get("top_p")):
        sent["top_p"] = FLT_MIN
    return json.dumps(sent).encode()


def _top_k_off(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def _f32_underflow(value: object) -> bool:
    return isinstance(value, float) and 0.0 < value < FLT_MIN
