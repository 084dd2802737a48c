"""One request's failure inside a shared step, kept apart from the step's other requests.

A step runs many requests' rows together (the forward, then sampling). When
it raises, the engine runs each row alone: a row that raises again is a
`RowError` and fails its own request with its own message, while the others
go on. When every row raises alone and a probe that belongs to no request
raises too, nothing points at a request: `StepFailed` says so, and the engine
treats it as its own fault (several bad requests in one step are not that).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.engine.request import RequestError


@dataclass(frozen=True, slots=True)
class RowError:
    """A row that raised when it ran alone: its request fails with this, and only it."""

    index: int  # into the step's rows
    message: str  # the exception's type and text, from this row's own run

    def request_error(self) -> RequestError:
        """What the request ends with: a server error carrying this row's own message only."""
        return RequestError(
            500,
            "server_error",
            f"the engine could not run this request: {self.message}",
            code="request_failed",
        )


class StepFailed(Exception):
    """Every row of a step raised alone, and so did a probe of no request: an engine fault."""


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
