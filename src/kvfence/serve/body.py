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

# The body limit: a floor every server takes, plus room per context token. A prompt that
# fills the context as token ids ("151643, ": 8 bytes a token) or as text (about 4 bytes a
# token; \uXXXX escapes 6 a character) fits several times over, and nothing bigger is read:
# a 10 MB body is refused from its Content-Length below ~290k tokens of context.
BODY_FLOOR = 1024 * 1024
BODY_BYTES_PER_TOKEN = 32


def body_limit_for(context_length: int) -> int:
    """The largest request body read for a model of `context_length` tokens, in bytes."""
    return BODY_FLOOR + BODY_BYTES_PER_TOKEN * context_length


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"request body exceeds {limit} bytes, this server's limit ({BODY_FLOOR} bytes plus "
        f"{BODY_BYTES_PER_TOKEN} per token of context); send a shorter prompt",
        code="body_too_large",
    )


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
