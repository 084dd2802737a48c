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
- With a `Pacing` (the statistical checks' clients), an availability failure
  (a 503, no HTTP answer) is sent again within it (`kvfence.audit.pacing`): the
  check judges only the answer that came back in the end, the failures before
  it on record. Without one, every answer is the check's to judge.
- A `ProbeResponse` keeps everything the server sent: the full body text
  (error bodies included) and, for streams, every raw SSE chunk, so the
  canary check can search all of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx

from kvfence.audit.budget import Budget
from kvfence.audit.pacing import Pacing, RetryAllowance, unavailable_reason
from kvfence.audit.probe_response import ProbeResponse, absorb_openai

__all__ = ["OPERATOR_PATHS", "ProbeClient", "ProbeResponse"]


# Paths that carry operator data on kvfence (and are harmless to read as operator elsewhere);
# `/workers` is a router's admin list (sglang-router's control plane takes only an admin key,
# which `kvfence serve --disaggregated` draws from the tenants file's operator keys).
OPERATOR_PATHS = frozenset({"/metrics", "/server_info", "/get_server_info", "/workers"})


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
        pacing: Pacing | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        # Sent instead of the tenant key on the operator paths (/metrics, /server_info):
        # engines that fence operator data (kvfence) answer a tenant key there with 403.
        self._operator_headers = {"Authorization": f"Bearer {operator_key}"} if operator_key else {}
        self.operator_key = operator_key
        self.budget = budget
        self.timeout_s = timeout_s
        self.retry = RetryAllowance(pacing if pacing is not None else Pacing(retries=0))
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

    def _paced(self, send: Callable[[], ProbeResponse]) -> ProbeResponse:
        """`send` until an answer comes back that is not an availability failure, or the
        pacing allows no further try (then the last failure comes back, as it is)."""
        seen: list[str] = []
        attempt = 0
        while True:
            resp = send()
            why = unavailable_reason(resp.status, resp.error)
            if why is None or not self.retry.allows(attempt):
                resp.unavailable = seen
                return resp
            pause = min(self.retry.pacing.pause_s(attempt), self.budget.remaining_s)
            self.retry.spend(resp.total_s + pause)
            seen.append(f"{why} after {resp.total_s:.1f} s")
            time.sleep(pause)
            attempt += 1

    def _send(
        self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float | None
    ) -> ProbeResponse:
        return self._paced(lambda: self._send_once(method, path, payload, timeout_s))

    def _send_once(
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
            absorb_openai(resp, resp.json)
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
        return self._paced(lambda: self._stream_once(path, payload, timeout_s))

    def _stream_once(
        self, path: str, payload: dict[str, Any], timeout_s: float | None
    ) -> ProbeResponse:
        self.budget.charge()
        resp = ProbeResponse(method="POST", path=path, request=dict(payload))
        timeout = self.budget.timeout_for(timeout_s or self.timeout_s)
        raw: list[str] = []
        t0 = time.perf_counter()
        deadline = t0 + timeout  # httpx's timeout is per read: a trickling stream is cut here
        try:
            with self._http.stream("POST", path, json=payload, timeout=timeout) as r:
                resp.status = r.status_code
                for line in sse_lines(r.iter_text()):
                    if time.perf_counter() > deadline:
                        resp.error = f"stream still open after {timeout:.0f} s: cut"
                        break
                    raw.append(line)
                    _absorb_sse_line(resp, line, t0)
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
                absorb_openai(resp, resp.json)
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


def sse_lines(texts: Iterable[str]) -> Iterator[str]:
    """The lines of an event stream: split at LF (a CR before it dropped), the only line end
    a JSON event can hold. Not `str.splitlines` (httpx's `iter_lines`), which also splits at
    U+0085, U+2028 and U+2029: JSON leaves them raw in a token's text, so one generated
    character cut the event in two and its TTFT went unread (real vLLM: about one trial in
    ten lost at a 2,432-token prefix)."""
    pending = ""
    for text in texts:
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


def _absorb_sse_line(resp: ProbeResponse, line: str, t0: float) -> None:
    """Keep one `data:` line as a chunk and fold its JSON in; the first choice stamps TTFT."""
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    resp.chunks.append(data)
    if data == "[DONE]":
        return
    try:
        obj = json.loads(data)
    except ValueError:
        return
    if isinstance(obj, dict):
        if resp.ttft_s is None and obj.get("choices"):
            resp.ttft_s = time.perf_counter() - t0
        absorb_openai(resp, obj, append=True)
