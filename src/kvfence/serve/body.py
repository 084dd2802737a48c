"""Reading a request body within its limits: size (413) and time (408).

A body is refused from its declared `Content-Length` before a byte is read
when it is over the limit, and while it is read once it crosses the limit
(chunked bodies declare no length). A body that does not arrive whole within
its deadline (a stalled or trickled upload, slowloris) is a 408, and one cut
off by the client is a 400: neither reaches admission, so neither allocates
anything, and neither is ever counted as a server error.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import ClientDisconnect, Request

from kvfence.serve.errors import ApiError


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body exceeds {limit} bytes", code="body_too_large")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return b"".join(chunks)
        except TimeoutError:
            raise ApiError(
                408,
                f"request body not received within {timeout_s:g} s ({size} bytes arrived)",
                code="body_timeout",
            ) from None
        except ClientDisconnect:
            raise ApiError(
                400,
                f"request body cut off by the client after {size} bytes",
                code="incomplete_body",
            ) from None
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
