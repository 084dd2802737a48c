"""What one probe got back: everything the server sent, and how an OpenAI-style answer (whole,
or one stream chunk at a time) folds into it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    - `unavailable`: why each earlier try of this request was not an answer (a 503, no HTTP
      answer) before the client sent it again (`kvfence.audit.pacing`); empty when the
      first try is the one here.
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
    unavailable: list[str] = field(default_factory=list)

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

    def outcome(self) -> str:
        """One phrase for a report: the status and the engine's own words for a failure
        ("HTTP 400: `prompt` holds token id 475, ..."), or why no answer came."""
        if self.status is None:
            return f"no HTTP answer: {self.error or 'no reason given'}"
        if self.ok:
            return f"HTTP {self.status}"
        said = " ".join((self.error_message or self.body).split())
        return f"HTTP {self.status}: {said[:300]}" if said else f"HTTP {self.status}, empty body"

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
            "outcome": self.outcome(),
            "text": self.text[:500],
            "body": self.body[:1000],
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "ttft_s": self.ttft_s,
            "total_s": round(self.total_s, 4),
            **({"unavailable_before": self.unavailable} if self.unavailable else {}),
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


def absorb_openai(resp: ProbeResponse, obj: dict[str, Any], append: bool = False) -> None:
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
