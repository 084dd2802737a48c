"""`/openapi.json`: the server's API as it is enforced, for clients and for generated attacks.

Honest by construction: the request schemas are built from the same field
sets and limits the parsers use (`protocol.COMPLETION_FIELDS`, `CHAT_FIELDS`,
`fields.NEUTRAL`, `fields.MAX_*`, the live context length, edge limit and
vocabulary), so a field the server accepts is in the schema, and every
other field is rejected by `additionalProperties: false` — exactly the
server's 400 `unknown_parameter`. Known-but-unimplemented fields appear with
their only accepted (neutral) value and are listed under
`x-kvfence-rejected-fields`. Rules between fields (`stream_options` only
with `stream: true`, `top_logprobs` only with `logprobs: true`) are in the
schema as `anyOf` alternatives. Limits it cannot express (a prompt's tokens
<= the context; prompt tokens + max_tokens <= max_req_input_len; max_tokens
and max_completion_tokens equal when both are sent) are stated in the
descriptions and answered 400 naming the field, with the codes listed under
the operation's `x-kvfence-beyond-schema` (`param:code`): a schema-valid
request is refused with no other 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvfence import __version__
from kvfence.serve import openapi_shapes as shapes
from kvfence.serve import protocol
from kvfence.serve.config import Capacity, ServeConfig
from kvfence.serve.fields import (
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    NEUTRAL,
    SEED_RANGE,
)

Schema = dict[str, Any]
JSON = "application/json"
ERROR_REF = {"$ref": "#/components/schemas/Error"}
# Statuses every authenticated route can answer, besides its own.
AUTH_ERRORS = {"401": "missing or invalid API key", "429": "tenant over its admission limits"}
OPERATOR_ONLY = {"403": "a tenant key on operator data (send an operator key)"}


def nullable(schema: Schema) -> Schema:
    """Every field reader treats `null` as "absent, use the default"."""
    return {"anyOf": [schema, {"type": "null"}]}


def _top_k() -> Schema:
    return {
        "type": "integer",
        "minimum": -1,
        "maximum": protocol.MAX_TOP_K,
        "description": "0 or -1: off",
    }


def _sampling(config: ServeConfig, capacity: Capacity) -> dict[str, Schema]:
    token_id = {"type": "integer", "minimum": 0, "maximum": config.vocab_size - 1}
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return {
        "model": _sampling_model(config),
        "max_tokens": nullable(
            {
                "type": "integer",
                "minimum": 1,
                "maximum": max(1, capacity.edge_limit - 1),
                "description": (
                    f"prompt tokens + max_tokens must be <= {capacity.edge_limit} "
                    "(max_req_input_len), else 400 naming max_tokens"
                ),
            }
        ),
        "temperature": nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}),
        "top_p": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": nullable(_top_k()),
        "seed": nullable({"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]}),
        "stop": nullable(
            {
                "anyOf": [
                    stop_string,
                    {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
                ]
            }
        ),
        "stop_token_ids": nullable({"type": "array", "items": token_id}),
        "ignore_eos": nullable({"type": "boolean"}),
        "stream": nullable({"type": "boolean"}),
        "stream_options": nullable(
            {
                "type": "object",
                "properties": {"include_usage": nullable({"type": "boolean"})},
                "additionalProperties": False,
                "description": "only with stream: true (400 otherwise)",
            }
        ),
        "cache_salt": nullable({"type": "string", "minLength": 1}),
    }


def _neutral() -> dict[str, Schema]:
    """Known fields the server does not implement: accepted only at their neutral value."""
    return {
        name: {
            "enum": [value, None] if value is not None else [None],
            "description": "not supported: any other value is a 400 unsupported_parameter",
        }
        for name, value in NEUTRAL.items()
    }


# 400s a schema-valid request can get: the limits JSON Schema cannot express (`param:code`).
BEYOND_SCHEMA: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "completions": ("prompt:context_length_exceeded", "prompt:pool_capacity_exceeded",
                    "max_tokens:context_length_exceeded", "max_tokens:pool_capacity_exceeded",
                    # behind sglang-router, which takes no token ids on this route
                    "prompt:unsupported_value"),
    "chat": ("messages:context_length_exceeded", "messages:pool_capacity_exceeded",
             "max_tokens:context_length_exceeded", "max_tokens:pool_capacity_exceeded",
             "max_completion_tokens:invalid_value",
             # behind sglang-router, which refuses a message whose content is empty
             "messages:empty_content"),
    # The character bound: no text that long fits the context, so none is tokenized.
    "tokenize": ("prompt:context_length_exceeded", "messages:context_length_exceeded"),
})  # fmt: skip


def _absent_or_null(name: str) -> Schema:
    return {"properties": {name: {"type": "null"}}}


def _only_with(name: str, flag: str) -> Schema:
    """`name` (when not null) only together with `flag: true`."""
    return {
        "anyOf": [
            _absent_or_null(name),
            {"properties": {flag: {"const": True}}, "required": [flag]},
        ]
    }


def _body(
    properties: dict[str, Schema], required: list[str], doc: str, rules: list[Schema]
) -> Schema:
    return {
        "type": "object",
        "properties": {**properties, **_neutral()},
        "required": required,
        "additionalProperties": False,
        "allOf": rules,
        "description": doc,
        "x-kvfence-rejected-fields": sorted(NEUTRAL),
    }


def _messages() -> Schema:
    text_part = {
        "type": "object",
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
        "required": ["type", "text"],
        "additionalProperties": False,
    }
    message = {
        "type": "object",
        "properties": {
            "role": {"enum": list(protocol.CHAT_ROLES)},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]},
        },
        "required": ["role", "content"],
        "additionalProperties": False,
    }
    return {"type": "array", "items": message, "minItems": 1}


def completion_request(config: ServeConfig, capacity: Capacity) -> Schema:
    common = _sampling(config, capacity)
    token_id = {"type": "integer", "minimum": 0, "maximum": config.vocab_size - 1}
    prompt = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": token_id, "minItems": 1},
        ],
        "description": (
            f"one prompt (batches are a 400); at most {config.context_length} tokens "
            "(context_length_exceeded otherwise)"
        ),
    }
    logprobs = nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS})
    fields = {**common, "prompt": prompt, "logprobs": logprobs}
    assert set(fields) == protocol.COMPLETION_FIELDS, "schema and parser disagree on fields"
    rules = [_only_with("stream_options", "stream")]
    return _body(fields, ["prompt"], "POST /v1/completions", rules)


def chat_request(config: ServeConfig, capacity: Capacity) -> Schema:
    common = _sampling(config, capacity)
    top = nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS})
    fields = {
        **common,
        "messages": _messages(),
        "max_completion_tokens": common["max_tokens"],
        "logprobs": nullable({"type": "boolean"}),
        "top_logprobs": {**top, "description": "only with logprobs: true"},
    }
    assert set(fields) == protocol.CHAT_FIELDS, "schema and parser disagree on fields"
    rules = [_only_with("stream_options", "stream"), _only_with("top_logprobs", "logprobs")]
    return _body(fields, ["messages"], "POST /v1/chat/completions", rules)


def _tokenize(config: ServeConfig) -> Schema:
    model = _sampling_model(config)
    return {
        "type": "object",
        "properties": {
            "model": model,
            "prompt": {"type": "string"},
            "messages": _messages(),
            "add_special_tokens": {"enum": [False, None]},
        },
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
        "additionalProperties": False,
    }


def _detokenize(config: ServeConfig) -> Schema:
    token_id = {"type": "integer", "minimum": 0, "maximum": config.vocab_size - 1}
    return {
        "type": "object",
        "properties": {
            "model": _sampling_model(config),
            "tokens": {"type": "array", "items": token_id},
        },
        "required": ["tokens"],
        "additionalProperties": False,
    }


def _sampling_model(config: ServeConfig) -> Schema:
    return nullable(
        {
            "type": "string",
            "enum": [config.model_name],
            "description": "the one model served; any other name is a 404 model_not_found",
        }
    )


# ---- the document ------------------------------------------------------------------------


def _json_body(schema: Schema) -> Schema:
    return {"required": True, "content": {JSON: {"schema": schema}}}


def _with_error(docs: dict[str, str]) -> dict[str, Schema]:
    return {
        s: {"description": d, "content": {JSON: {"schema": ERROR_REF}}} for s, d in docs.items()
    }


def _errors(*statuses: str, auth: bool = True) -> dict[str, Schema]:
    docs = {
        "400": "a field is invalid or over its limit; `error.param` names it",
        "404": "no such model (`error.param` is model)",
        "413": "request body over the limit",
        "503": "the request failed in the backend (a worker died or missed a deadline)",
    }
    out = {s: docs[s] for s in statuses}
    if auth:
        out |= AUTH_ERRORS
    return {s: {"description": d, "content": {JSON: {"schema": ERROR_REF}}} for s, d in out.items()}


def _ok(schema: Schema, media: str = JSON, stream: bool = False) -> dict[str, Schema]:
    content = {media: {"schema": schema}}
    if stream:
        event = {
            "type": "object",
            "properties": {"data": {"type": "string"}},
            "required": ["data"],
            "description": "one SSE event: a chunk or an error object as JSON, then [DONE]",
        }
        content["text/event-stream"] = {"itemSchema": event}
    return {"200": {"description": "OK", "content": content}}


def _op(op_id: str, responses: dict[str, Schema], body: Schema | None = None) -> Schema:
    op: Schema = {"operationId": op_id, "responses": responses}
    if op_id in BEYOND_SCHEMA:
        op["x-kvfence-beyond-schema"] = list(BEYOND_SCHEMA[op_id])
    if body is not None:
        op["requestBody"] = _json_body(body)
    return op


def build_openapi(config: ServeConfig, capacity: Capacity) -> dict[str, Any]:
    """The OpenAPI 3.1 document of this server, from its live limits."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvfence", "version": __version__, "description": __doc__},
        "paths": _token_paths(config, capacity) | _service_paths(),
        "security": [{"bearer": []}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": shapes.error()},
        },
    }


def _token_paths(config: ServeConfig, capacity: Capacity) -> dict[str, Any]:
    """The routes that take tokens: generation, tokenize, detokenize."""
    gen = ("400", "404", "413", "503")
    return {
        "/v1/completions": {
            "post": _op(
                "completions",
                _ok(shapes.completion(), stream=True) | _errors(*gen),
                completion_request(config, capacity),
            )
        },
        "/v1/chat/completions": {
            "post": _op(
                "chat",
                _ok(shapes.chat(), stream=True) | _errors(*gen),
                chat_request(config, capacity),
            )
        },
        "/tokenize": {
            "post": _op(
                "tokenize",
                _ok(shapes.tokenized()) | _errors("400", "404", "413"),
                _tokenize(config),
            )
        },
        "/detokenize": {
            "post": _op(
                "detokenize",
                _ok(shapes.detokenized()) | _errors("400", "404", "413"),
                _detokenize(config),
            )
        },
    }


def _service_paths() -> dict[str, Any]:
    return {
        "/v1/models": {"get": _op("models", _ok(shapes.models()) | _errors())},
        "/server_info": {"get": _op("server_info", _ok(shapes.server_info()) | _errors())},
        "/get_server_info": {"get": _op("get_server_info", _ok(shapes.server_info()) | _errors())},
        "/metrics": {
            "get": _op(
                "metrics",
                _ok({"type": "string"}, "text/plain") | _errors() | _with_error(OPERATOR_ONLY),
            )
        },
        "/openapi.json": {"get": _op("openapi", _ok({"type": "object"}) | _errors())},
        "/health": {
            "get": {
                "operationId": "health",
                "security": [],
                "responses": {"200": {"description": "the server is up (empty body)"}},
            }
        },
        "/version": {
            "get": {
                "operationId": "version",
                "security": [],
                "responses": _ok(shapes.version()),
            }
        },
    }
