"""`POST /generate`, SGLang's native route, on a worker: the completion path in SGLang's shapes.

Request (SGLang 0.5 `GenerateReqInput`): `text` or `input_ids` (one prompt,
not a batch), `sampling_params` and `stream`. It is rewritten into the
`/v1/completions` body and served by the same router path, so the tenant is
authenticated from `Authorization` first (I10), the router's bootstrap fields
go through `fields.py` (I9: honoured only on the router's path; `rid` refused
everywhere) and every limit answers the same 400. Every field is honoured or
refused with a 400 naming it; the options sglang-router 0.3.2 writes into
every `/generate` body (`ROUTER_DEFAULTS`, seen live) are accepted only at
those values.

Response: `{"text", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens"}}`, `finish_reason` in SGLang's form
(`{"type": "length", "length": n}` or `{"type": "stop"}`). Streamed, each
event carries the text so far (SGLang's default) with `finish_reason` null;
the last one carries the finish reason and the token counts. An error is the
same error envelope as on the OpenAI routes, never a 200.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message

from kvfence.serve import protocol
from kvfence.serve.app import route
from kvfence.serve.body import read_body
from kvfence.serve.errors import ApiError, bad_request
from kvfence.serve.fields import load_json
from kvfence.serve.responses import DONE, sse
from kvfence.serve.router import Router
from kvfence.sglang_stack.fields import BOOTSTRAP_FIELDS

# sglang-router 0.3.2 writes these into every /generate body (with `"model": null`).
ROUTER_DEFAULTS: dict[str, object] = {
    "return_text_in_logprobs": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_logprob": False,
}
# SGLang sampling param -> the completion field that implements it.
SAMPLING: dict[str, str] = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",  # -1 = off, as in SGLang
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "sampling_seed": "seed",
}
SAMPLING_DEFAULTS: dict[str, object] = {"n": 1, "skip_special_tokens": True, "no_stop_trim": False}
# Passed through for the completion path to judge: the router's room (I9) and a client's rid.
PASSED = (*BOOTSTRAP_FIELDS, "rid")


def completion_body(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The `/v1/completions` body that serves this `/generate` body; a 400 names a bad field."""
    body: dict[str, Any] = {name: obj[name] for name in PASSED if name in obj}
    body["prompt"] = _prompt(obj)
    for name, value in obj.items():
        if name in PASSED or name in ("text", "input_ids", "sampling_params"):
            continue
        if name == "stream":
            body["stream"] = value
            body["stream_options"] = {"include_usage": True}  # the last event's counts
        elif name == "model":
            if value is not None:
                body["model"] = value
        elif name in ROUTER_DEFAULTS:
            _only_default(name, value, ROUTER_DEFAULTS[name])
        else:
            raise bad_request(f"`{name}` is not supported on /generate", name, "unknown_parameter")
    body.update(_sampling(obj.get("sampling_params")))
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    _check(body, "text" if "text" in obj else "input_ids")
    return body


def _check(body: Mapping[str, Any], prompt_field: str) -> None:
    """The completion parser's verdict now, its 400 naming the field as the client spelt it."""
    try:
        protocol.parse_completion({k: v for k, v in body.items() if k not in PASSED})
    except ApiError as e:
        names = {"prompt": prompt_field, **{v: f"sampling_params.{k}" for k, v in SAMPLING.items()}}
        name = names.get(e.param or "")
        if name is None:
            raise
        message = e.message.replace(f"`{e.param}`", f"`{name}`")
        raise ApiError(e.status, message, type=e.type, param=name, code=e.code) from None


def _prompt(obj: Mapping[str, Any]) -> str | list[int]:
    text, ids = obj.get("text"), obj.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request(
            "/generate needs exactly one of `text` and `input_ids`",
            "text" if text is not None else "input_ids",
            "missing_required_parameter" if text is None else "invalid_value",
        )
    if text is not None and not isinstance(text, str):
        raise bad_request(
            "`text` must be one string; batched prompts are not supported (send one request "
            "per prompt)",
            "text",
        )
    if text is None and not (
        isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise bad_request(
            "`input_ids` must be one list of token ids; batched prompts are not supported",
            "input_ids",
        )
    return text if isinstance(text, str) else [int(t) for t in ids or ()]


def _sampling(params: Any) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise bad_request("`sampling_params` must be an object", "sampling_params")
    out: dict[str, Any] = {}
    for name, value in params.items():
        where = f"sampling_params.{name}"
        if name in SAMPLING:
            out[SAMPLING[name]] = value
        elif name in SAMPLING_DEFAULTS:
            _only_default(where, value, SAMPLING_DEFAULTS[name])
        else:
            raise bad_request(f"`{where}` is not supported by kvfence", where, "unknown_parameter")
    return out


def _only_default(name: str, value: object, default: object) -> None:
    if type(value) is not type(default) or value != default:
        raise bad_request(
            f"`{name}` = {value!r} is not supported by kvfence (only {default!r})", name
        )


# ---- the answer, in SGLang's shape ---------------------------------------------------------


def finish_reason(reason: str | None, completion_tokens: int) -> dict[str, Any] | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": reason}


def meta_info(rid: str, reason: str | None, usage: Mapping[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "finish_reason": None}
    if usage is not None:
        done = int(usage["completion_tokens"])
        meta["finish_reason"] = finish_reason(reason, done)
        meta["prompt_tokens"] = int(usage["prompt_tokens"])
        meta["completion_tokens"] = done
        meta["cached_tokens"] = int(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
    return meta


def generate_body(completion: Mapping[str, Any]) -> dict[str, Any]:
    (choice,) = completion["choices"]
    meta = meta_info(str(completion["id"]), choice.get("finish_reason"), completion["usage"])
    return {"text": choice["text"], "meta_info": meta}


async def generate_events(events: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
    """The completion stream's events as SGLang's: text so far; counts on the last one."""
    text, reason, rid = "", None, ""
    async for raw in events:
        event = raw.decode() if isinstance(raw, bytes) else raw
        data = event.strip().removeprefix("data: ")
        if data == "[DONE]":
            yield DONE
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            yield event  # the same error envelope, then [DONE]: never a silent end
            continue
        rid = str(chunk.get("id", rid))
        if chunk.get("usage") is not None:
            yield sse({"text": text, "meta_info": meta_info(rid, reason, chunk["usage"])})
            continue
        for choice in chunk.get("choices", ()):
            text += choice.get("text", "")
            reason = choice.get("finish_reason") or reason
            if reason is None:  # the finishing piece's text goes out with the counts
                yield sse({"text": text, "meta_info": meta_info(rid, None, None)})


async def generate(router: Router, request: Request) -> Response:
    """Authenticate, rewrite, serve on the completion path, answer in SGLang's shape."""
    admission = router.admission
    try:
        admission.authenticate(request.headers.get("authorization"))  # I10: 401 before any body
        raw = await read_body(request, admission.body_limit, router.config.body_timeout_s)
        body = json.dumps(completion_body(load_json(raw))).encode()
    except ApiError as e:
        router.counters.rejected(e.code or e.type)
        raise
    answer = await router.generate(_with_body(request, body), "completion")
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(
            generate_events(answer.body_iterator),  # type: ignore[arg-type]
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    if answer.status_code != 200:
        return answer
    return JSONResponse(generate_body(json.loads(bytes(answer.body))))


def add_generate_route(app: Starlette) -> None:
    router: Router = app.state.router

    async def generate_route(request: Request) -> Response:
        return await generate(router, request)

    app.router.routes.append(route("/generate", generate_route, "POST"))


def _with_body(request: Request, body: bytes) -> Request:
    """The same request (scope, headers, client) on the completion path, carrying `body`."""
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    path = "/v1/completions"
    scope = dict(request.scope, path=path, raw_path=path.encode(), headers=headers)
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()  # then the client's own disconnect

    return Request(scope, receive)
