"""The errors a client receives: an OpenAI-style status and body."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An OpenAI-style error: the status and body the client receives."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


INTERNAL_ERROR = ApiError(
    500,
    "internal server error; the request was stopped",
    type="server_error",
    code="internal_error",
)
