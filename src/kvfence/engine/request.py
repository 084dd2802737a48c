"""The request lifecycle: an explicit state machine (invariants I2, I6).

REJECTED, ABORTED and FAILED are terminal and distinct from FINISHED. Code
that decides whether to work on a request tests an allow-list
(`req.state is RequestState.PREFILLING`), never `not req.finished()`: the
Workers AI leak was a rejected request that `finished()` still called alive.
Every request ends exactly once; a second terminal transition raises.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvfence.engine.messages import ErrorInfo


class RequestState(enum.Enum):
    WAITING = "waiting"
    BOOTSTRAPPING = "bootstrapping"  # decode is reserving pages for the prompt
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"  # KV on its way from prefill to decode
    DECODING = "decoding"
    FINISHED = "finished"  # success with content
    REJECTED = "rejected"  # refused before or at admission (over-long, bad input)
    ABORTED = "aborted"  # cancelled by the client or an operator
    FAILED = (
        "failed"  # an engine-side error after admission (transfer mismatch, violation, timeout)
    )

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset(
    {RequestState.FINISHED, RequestState.REJECTED, RequestState.ABORTED, RequestState.FAILED}
)

# The union of the router's, prefill's and decode's views of one request.
# Prefill: WAITING -> PREFILLING -> TRANSFERRING -> FINISHED (its part done).
# Decode: WAITING -> BOOTSTRAPPING -> TRANSFERRING -> DECODING -> FINISHED.
_S = RequestState
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.WAITING: frozenset({_S.BOOTSTRAPPING, _S.PREFILLING, _S.REJECTED, _S.ABORTED, _S.FAILED}),
    _S.BOOTSTRAPPING: frozenset(
        {_S.PREFILLING, _S.TRANSFERRING, _S.REJECTED, _S.ABORTED, _S.FAILED}
    ),
    _S.PREFILLING: frozenset({_S.TRANSFERRING, _S.DECODING, _S.REJECTED, _S.ABORTED, _S.FAILED}),
    _S.TRANSFERRING: frozenset({_S.DECODING, _S.FINISHED, _S.ABORTED, _S.FAILED}),
    _S.DECODING: frozenset({_S.FINISHED, _S.ABORTED, _S.FAILED}),
    _S.FINISHED: frozenset(),
    _S.REJECTED: frozenset(),
    _S.ABORTED: frozenset(),
    _S.FAILED: frozenset(),
}


class IllegalTransition(Exception):
    """A state change the table does not allow (including a second terminal outcome)."""


@dataclass(frozen=True, slots=True)
class RequestError:
    """The original error, carried unchanged from where it happened to the client."""

    status: int  # HTTP status the client receives
    type: str  # OpenAI-style error type, e.g. "invalid_request_error"
    message: str  # what was wrong and what the limit is
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        if not 400 <= self.status <= 599:
            raise ValueError(f"an error status must be 4xx or 5xx, got {self.status}")

    def info(self) -> ErrorInfo:
        """The same error as the wire message that carries it to the router."""
        return ErrorInfo(self.status, self.type, self.message, self.param, self.code)


@dataclass(slots=True)
class Request:
    """One request's lifecycle. `prompt_ids` is never rewritten by a reject path."""

    rid: str
    tenant: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    state: RequestState = RequestState.WAITING
    error: RequestError | None = None
    finish_reason: str | None = None
    history: list[RequestState] = field(default_factory=list)
    # The legacy reject field of SGLang #30233, written only under the lab's
    # `abort-not-terminal` fault switch. Production code never reads it.
    to_finish: RequestError | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        self.history.append(self.state)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def advance(self, new: RequestState) -> None:
        """Move along the table; an illegal move raises and changes nothing.

        Error endings go through `reject` / `abort` / `fail` only, so they always
        carry the original error (I6): a bare `advance(REJECTED)` raises.
        """
        if new in (RequestState.REJECTED, RequestState.ABORTED, RequestState.FAILED):
            raise IllegalTransition(
                f"request {self.rid}: end with reject/abort/fail so the error travels, "
                f"not advance({new.value})"
            )
        self._move(new)

    def _move(self, new: RequestState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"request {self.rid}: {self.state.value} -> {new.value} is not allowed"
            )
        self.state = new
        self.history.append(new)

    def finish(self, reason: str) -> None:
        if reason not in ("stop", "length"):
            raise ValueError(f"finish reason must be 'stop' or 'length', got {reason!r}")
        self.advance(RequestState.FINISHED)
        self.finish_reason = reason

    def reject(self, error: RequestError) -> None:
        self._end_with(RequestState.REJECTED, error)

    def abort(self, error: RequestError) -> None:
        self._end_with(RequestState.ABORTED, error)

    def fail(self, error: RequestError) -> None:
        self._end_with(RequestState.FAILED, error)

    def _end_with(self, state: RequestState, error: RequestError) -> None:
        self._move(state)
        self.error = error

    def legacy_finished(self) -> bool:
        """SGLang's pre-fix `finished()`: blind to `to_finish`. Used only under `abort-not-terminal`."""
        return self.state.terminal
