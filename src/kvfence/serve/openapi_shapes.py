"""The response schemas of `/openapi.json`: what `responses.py`, `app.py` and `info.py` send."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]
INT = {"type": "integer", "minimum": 0}
STR = {"type": "string"}


def _obj(properties: dict[str, Schema], *, closed: bool = True) -> Schema:
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": not closed,
    }


def error() -> Schema:
    """Every 4xx/5xx body: OpenAI's error envelope; `param` names the field when one is at fault."""
    nullable_str = {"type": ["string", "null"]}
    inner = _obj(
        {"message": {"type": "string", "minLength": 1}, "type": STR, "param": nullable_str,
         "code": nullable_str}
    )  # fmt: skip
    return _obj({"error": inner})


def usage() -> Schema:
    return _obj(
        {
            "prompt_tokens": INT,
            "completion_tokens": INT,
            "total_tokens": INT,
            "prompt_tokens_details": _obj({"cached_tokens": INT}),
        }
    )


def _envelope(obj: str, choice: Schema) -> Schema:
    return _obj(
        {
            "id": STR,
            "object": {"enum": [obj]},
            "created": INT,
            "model": STR,
            "choices": {"type": "array", "items": choice, "minItems": 1, "maxItems": 1},
            "usage": usage(),
        }
    )


_FINISH = {"enum": ["stop", "length"]}
_LOGPROBS = {"type": ["object", "null"]}


def completion() -> Schema:
    choice = _obj({"index": INT, "text": STR, "logprobs": _LOGPROBS, "finish_reason": _FINISH})
    return _envelope("text_completion", choice)


def chat() -> Schema:
    message = _obj({"role": {"enum": ["assistant"]}, "content": STR})
    choice = _obj(
        {"index": INT, "message": message, "logprobs": _LOGPROBS, "finish_reason": _FINISH}
    )
    return _envelope("chat.completion", choice)


def tokenized() -> Schema:
    return _obj({"count": INT, "max_model_len": INT, "tokens": {"type": "array", "items": INT}})


def detokenized() -> Schema:
    return _obj({"prompt": STR})


def version() -> Schema:
    """`/version` (serve/version.py): the installed package's version, no key needed."""
    return _obj({"version": {"type": "string", "minLength": 1}, "engine": {"const": "kvfence"}})


def models() -> Schema:
    model = _obj(
        {
            "id": STR,
            "object": {"enum": ["model"]},
            "created": INT,
            "owned_by": STR,
            "max_model_len": INT,
        }
    )
    return _obj({"object": {"enum": ["list"]}, "data": {"type": "array", "items": model}})


def server_info() -> Schema:
    """The audit kit's contract: these keys are always there; new ones may be added.

    Live pool usage (`pools[].pages_*`) and `lab` are operator data: present for the
    operator key, absent for a tenant key (which gets its own `usage` instead).
    """
    pool = {"type": "object", "required": ["role", "page_size"]}
    shape = _obj(
        {
            "engine": {"enum": ["kvfence"]},
            "version": STR,
            "model": STR,
            "context_length": INT,
            "max_model_len": INT,
            "max_req_input_len": INT,
            "max_total_num_tokens": INT,
            "pools": {"type": "array", "items": pool},
            "capacity_gate": {"type": "object"},
            "undersized_pool": {"type": "boolean"},
            "auth": {"enum": ["api-key", "none"]},
            "lab": {"type": "object"},
        },
        closed=False,
    )
    shape["required"] = [k for k in shape["required"] if k != "lab"]
    return shape
