"""Response shaping: OpenAI-compatible envelopes, stream chunks, logprobs and usage.

Pure functions of what the router collected; nothing here sees the backend or
decides an outcome. `Shape` is one response's fixed identity (its id, kind,
creation time, model): the id is independent of the room, which clients
never learn (I9).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfence.serve.protocol import GenerationRequest, Kind

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token: its text, logprob and the top alternatives (text, logprob)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class Piece:
    """What to send the client now: new text, its tokens' logprobs, and the end if it came."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    text_start: int  # offset of `text` in the whole completion (completions logprobs)


@dataclass(frozen=True, slots=True)
class Shape:
    """How one response is dressed: the same id and time on every chunk."""

    req: GenerationRequest
    model: str
    response_id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> Kind:
        return self.req.kind

    def envelope(self, *, final: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj, prefix = ("chat.completion" if final else "chat.completion.chunk"), "chatcmpl-"
        else:
            obj, prefix = "text_completion", "cmpl-"
        return {
            "id": prefix + self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
        }

    def body(
        self,
        content: str,
        entries: Sequence[TokenLogprob],
        finish_reason: str | None,
        usage: dict[str, Any],
    ) -> dict[str, Any]:
        """The non-streamed answer."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": content}}
        else:
            choice = {"index": 0, "text": content}
        lp = self.logprobs(entries, 0)
        return {
            **self.envelope(final=True),
            "choices": [{**choice, "logprobs": lp, "finish_reason": finish_reason}],
            "usage": usage,
        }

    def role_chunk(self) -> str:
        """The first chunk of a chat stream, announcing the assistant."""
        return self.chunk({"role": "assistant", "content": ""}, None, None)

    def piece_chunk(self, piece: Piece) -> str:
        lp = self.logprobs(piece.logprobs, piece.text_start)
        payload: dict[str, Any] | str
        if self.kind == "chat":
            payload = {"content": piece.text} if piece.text else {}
        else:
            payload = piece.text
        return self.chunk(payload, lp, piece.finish_reason)

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        return sse({**self.envelope(final=False), "choices": [], "usage": usage})

    def chunk(
        self,
        payload: dict[str, Any] | str,
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
    ) -> str:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": payload}
        else:
            choice = {"index": 0, "text": payload}
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return sse({**self.envelope(final=False), "choices": [choice]})

    def logprobs(self, entries: Sequence[TokenLogprob], start: int) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(entries)
        return completion_logprobs(entries, start)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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
