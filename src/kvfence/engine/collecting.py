"""A sink that gathers one request's events, for tests, replays and scripts.

`CollectingSink` is a `Sink` (engine/backend.py): it records every event and
`wait()` returns the request's `Result` once its one terminal event (I6) came.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvfence.engine.messages import ErrorInfo, Failure, TokenChunk


@dataclass(slots=True)
class Result:
    token_ids: list[int]
    logprobs: list[tuple[tuple[int, float], ...]]
    finish_reason: str | None
    error: ErrorInfo | None
    cached_tokens: int


class CollectingSink:
    """A sink that gathers one request's events; `wait()` returns its `Result`."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result = Result([], [], None, None, 0)
        self.events: list[TokenChunk | Failure] = []

    def __call__(self, event: TokenChunk | Failure) -> None:
        self.events.append(event)
        r = self._result
        if isinstance(event, Failure):
            r.error = event.error
            self._done.set()
            return
        r.token_ids.extend(event.token_ids)
        r.logprobs.extend(event.logprobs)
        r.cached_tokens = event.cached_tokens
        if event.finish_reason is not None:
            r.finish_reason = event.finish_reason
            self._done.set()

    def wait(self, timeout: float | None = None) -> Result:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request did not end within {timeout} s")
        return self._result
