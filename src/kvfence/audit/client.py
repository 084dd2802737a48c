"""A bounded OpenAI-compatible HTTP client for probing one target.

Contract:
- Talks only to `base_url` (the target given on the command line); paths are
  joined to it, never followed elsewhere (redirects are not followed).
- Every request is charged to the shared `Budget` before it is sent and its
  timeout is capped by the budget's remaining time; `BudgetExhausted`
  propagates (the check becomes inconclusive).
- Network trouble is *not* an exception: it comes back as a `ProbeResponse`
  with `status=None` and `error` set, so a check decides (fail closed:
  usually inconclusive).
- A `ProbeResponse` keeps everything the server sent: the full body text
  (error bodies included) and, for streams, every raw SSE chunk, so the
  canary check can search all of it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfence.audit.base import Budget


@dataclass(slots=True)
class ProbeResponse:
    """What one request got back.

    - `status`: HTTP status, None when no HTTP answer came (then `error` says why).
    - `body`: the full response text (for streams: all chunks joined).
    - `chunks`: every SSE `data:` payload of a stream, raw, in order.
    - `texts`: the generated text per choice index (joined across chunks).
    - `usage`: the `usage` object if the server sent one; `prompt_tokens`,
      `cached_tokens` (usage.prompt_tokens_details.cached_tokens) from it.
    - `ttft_s`: streams only: seconds from sending to the first chunk that
      carries a choice (the first generated token; with max_tokens=1 this is
      the prefill time seen by the client). `total_s`: until the body ended.
    - `finish_reasons` per choice; `logprobs`: the raw `logprobs` of choice 0.
    - `json`: the parsed body for non-stream responses (None if not JSON).
    """

    method: str
    path: str
    request: dict[str, Any] = field(default_factory=dict)
    status: int | None = None
    body: str = ""
    chunks: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    finish_reasons: list[str | None] = field(default_factory=list)
    logprobs: Any = None
    json: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def answered(self) -> bool:
        """An HTTP answer arrived (any status)."""
        return self.status is not None

    @property
    def text(self) -> str:
        """Choice 0's text ("" when none)."""
        return self.texts[0] if self.texts else ""

    @property
    def finish_reason(self) -> str | None:
        return self.finish_reasons[0] if self.finish_reasons else None

    @property
    def prompt_tokens(self) -> int | None:
        v = (self.usage or {}).get("prompt_tokens")
        return v if isinstance(v, int) else None

    @property
    def completion_tokens(self) -> int | None:
        v = (self.usage or {}).get("completion_tokens")
        return v if isinstance(v, int) else None

    @property
    def cached_tokens(self) -> int | None:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        v = details.get("cached_tokens") if isinstance(details, dict) else None
        return v if isinstance(v, int) else None

    @property
    def error_message(self) -> str:
        """The server's error text when it sent an OpenAI-style error ("" otherwise)."""
        j = self.json
        if isinstance(j, dict):
            err = j.get("error")
            if isinstance(err, dict):
                return str(err.get("message", ""))
            if isinstance(err, str):
                return err
            if "detail" in j:
                return str(j["detail"])
            if "message" in j and not self.ok:
                return str(j["message"])
        return ""

    def searchable(self) -> str:
        """Everything the server sent, for content searches: body, all chunks, all texts."""
        return "\n".join([self.body, *self.chunks, *self.texts])

    def brief(self) -> dict[str, Any]:
        """A compact JSON-serialisable record for evidence."""
        return {
            "method": self.method,
            "path": self.path,
            "request": _truncate_request(self.request),
            "status": self.status,
            "error": self.error,
            "text": self.text[:500],
            "body": self.body[:1000],
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "ttft_s": self.ttft_s,
            "total_s": round(self.total_s, 4),
        }


def _truncate_request(req: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in req.items():
        if isinstance(v, str) and len(v) > 300:
            out[k] = v[:150] + f"…[{len(v)} chars]…" + v[-100:]
        elif isinstance(v, list) and len(v) > 40:
            out[k] = [*v[:20], f"…[{len(v)} items]…", *v[-10:]]
        else:
            out[k] = v
    return out


# Paths that carry operator data on kvfence (and are harmless to read as operator elsewhere).
OPERATOR_PATHS = frozenset({"/metrics", "/server_info", "/get_server_info"})


class ProbeClient:
    """One tenant's bounded client for one target (thread-safe: httpx.Client is)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        budget: Budget,
        timeout_s: float = 120.0,
        model: str | None = None,
        transport: httpx.BaseTransport | None = None,
        operator_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        # Sent instead of the tenant key on the operator paths (/metrics, /server_info):
        # engines that fence operator data (kvfence) answer a tenant key there with 403.
        self._operator_headers = {"Authorization": f"Bearer {operator_key}"} if operator_key else {}
        self.operator_key = operator_key
        self.budget = budget
        self.timeout_s = timeout_s
        # The model name sent with generation requests; a target adapter sets
        # it from /v1/models. None → the field is omitted.
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            follow_redirects=False,  # only the given target is contacted
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    # -- plain requests ----------------------------------------------------

    def get(self, path: str, *, timeout_s: float | None = None) -> ProbeResponse:
        return self._send("GET", path, None, timeout_s)

    def operator_path(self, path: str) -> bool:
        return bool(self._operator_headers) and path.split("?")[0] in OPERATOR_PATHS

    def post(
        self, path: str, payload: dict[str, Any], *, timeout_s: float | None = None
    ) -> ProbeResponse:
        return self._send("POST", path, payload, timeout_s)

    def _send(
        self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float | None
    ) -> ProbeResponse:
        self.budget.charge()
        resp = ProbeResponse(method=method, path=path, request=dict(payload or {}))
        timeout = self.budget.timeout_for(timeout_s or self.timeout_s)
        t0 = time.perf_counter()
        try:
            headers = self._operator_headers if self.operator_path(path) else None
            r = self._http.request(method, path, json=payload, timeout=timeout, headers=headers)
        except httpx.HTTPError as e:
            resp.error = f"{type(e).__name__}: {e}"
            resp.total_s = time.perf_counter() - t0
            return resp
        resp.total_s = time.perf_counter() - t0
        resp.status = r.status_code
        resp.body = r.text
        try:
            resp.json = r.json()
        except ValueError:
            resp.json = None
        if isinstance(resp.json, dict):
            _absorb_openai(resp, resp.json)
        return resp

    # -- OpenAI-compatible generation -------------------------------------

    def completion(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        stream: bool = False,
        logprobs: int | None = None,
        extra: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> ProbeResponse:
        """POST /v1/completions; `prompt` as text or as token ids."""
        payload: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if logprobs is not None:
            payload["logprobs"] = logprobs
        return self._generate("/v1/completions", payload, stream, extra, timeout_s)

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        stream: bool = False,
        extra: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> ProbeResponse:
        """POST /v1/chat/completions."""
        payload: dict[str, Any] = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        return self._generate("/v1/chat/completions", payload, stream, extra, timeout_s)

    def ttft(
        self, prompt: str | list[int], *, extra: dict[str, Any] | None = None
    ) -> ProbeResponse:
        """A streaming max_tokens=1 completion: `ttft_s` is the prefill time seen by the client."""
        return self.completion(prompt, max_tokens=1, stream=True, extra=extra)

    def _generate(
        self,
        path: str,
        payload: dict[str, Any],
        stream: bool,
        extra: dict[str, Any] | None,
        timeout_s: float | None,
    ) -> ProbeResponse:
        if self.model is not None:
            payload["model"] = self.model
        if extra:
            payload.update(extra)
        if not stream:
            return self.post(path, payload, timeout_s=timeout_s)
        payload["stream"] = True
        payload.setdefault("stream_options", {"include_usage": True})
        return self._stream(path, payload, timeout_s)

    def _stream(self, path: str, payload: dict[str, Any], timeout_s: float | None) -> ProbeResponse:
        self.budget.charge()
        resp = ProbeResponse(method="POST", path=path, request=dict(payload))
        timeout = self.budget.timeout_for(timeout_s or self.timeout_s)
        raw: list[str] = []
        t0 = time.perf_counter()
        deadline = t0 + timeout  # httpx's timeout is per read: a trickling stream is cut here
        try:
            with self._http.stream("POST", path, json=payload, timeout=timeout) as r:
                resp.status = r.status_code
                for line in r.iter_lines():
                    if time.perf_counter() > deadline:
                        resp.error = f"stream still open after {timeout:.0f} s: cut"
                        break
                    raw.append(line)
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    resp.chunks.append(data)
                    if data == "[DONE]":
                        continue
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        if resp.ttft_s is None and obj.get("choices"):
                            resp.ttft_s = time.perf_counter() - t0
                        _absorb_openai(resp, obj, append=True)
        except httpx.HTTPError as e:
            resp.error = f"{type(e).__name__}: {e}"
        resp.total_s = time.perf_counter() - t0
        resp.body = "\n".join(raw)
        if not resp.chunks:
            # A non-stream answer to a stream request (typically an error body).
            try:
                resp.json = json.loads(resp.body) if resp.body else None
            except ValueError:
                resp.json = None
            if isinstance(resp.json, dict):
                _absorb_openai(resp, resp.json)
        return resp

    # -- tokenizer access ---------------------------------------------------

    def tokenize(self, text: str) -> list[int] | None:
        """POST /tokenize (vLLM, SGLang, kvfence; llama.cpp returns `tokens`); None if absent."""
        payload: dict[str, Any] = {"prompt": text}
        if self.model is not None:
            payload["model"] = self.model
        toks = _tokens(self.post("/tokenize", payload))
        if not toks and text:
            # llama.cpp names the field `content` (and may answer 200 with no tokens otherwise).
            toks = _tokens(self.post("/tokenize", {"content": text}))
        return toks or None

    def detokenize(self, ids: list[int]) -> str | None:
        """POST /detokenize; None if absent."""
        payload: dict[str, Any] = {"tokens": ids}
        if self.model is not None:
            payload["model"] = self.model
        r = self.post("/detokenize", payload)
        if r.ok and isinstance(r.json, dict):
            v = r.json.get("prompt", r.json.get("content"))
            if isinstance(v, str):
                return v
        return None


def _tokens(r: ProbeResponse) -> list[int] | None:
    if not r.ok or not isinstance(r.json, dict):
        return None
    toks = r.json.get("tokens")
    if isinstance(toks, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        return toks
    return None


def _absorb_openai(resp: ProbeResponse, obj: dict[str, Any], append: bool = False) -> None:
    """Fold a completion / chat object (or one stream chunk of it) into `resp`."""
    usage = obj.get("usage")
    if isinstance(usage, dict):
        resp.usage = usage
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        idx = ch.get("index", 0)
        idx = idx if isinstance(idx, int) and idx >= 0 else 0
        while len(resp.texts) <= idx:
            resp.texts.append("")
            resp.finish_reasons.append(None)
        piece = ch.get("text")
        if piece is None:
            msg = ch.get("delta") or ch.get("message") or {}
            piece = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(piece, str):
            resp.texts[idx] = resp.texts[idx] + piece if append else piece
        if ch.get("finish_reason") is not None:
            resp.finish_reasons[idx] = ch.get("finish_reason")
        if idx == 0 and ch.get("logprobs") is not None:
            if append and resp.logprobs is not None:
                resp.logprobs = _merge_logprobs(resp.logprobs, ch["logprobs"])
            else:
                resp.logprobs = ch["logprobs"]


def _merge_logprobs(old: Any, new: Any) -> Any:
    """Concatenate streamed logprobs (completion shape: lists per key; chat: `content`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for k, v in new.items():
            if isinstance(v, list) and isinstance(merged.get(k), list):
                merged[k] = [*merged[k], *v]
            else:
                merged[k] = v
        return merged
    return new
