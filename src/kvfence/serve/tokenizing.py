"""Tokenizing off the event loop, in a pool bounded by the machine's cores.

Encoding a prompt and rendering a chat template cost about a microsecond per
character: on the event loop, one large prompt would stall every other
tenant's requests (their admission, their streamed tokens) for as long. Work
above `INLINE_BYTES` of body therefore runs in a thread pool sized to the
usable cores, the bound on how much of the machine tokenizing can take
(half of them: the engine's step and the event loop keep the rest; the
`tokenizers` library releases the GIL while it encodes, so the loop keeps
running). Small bodies are tokenized inline: their cost is below a thread hop's
and they never queue behind a large one.

`Encodings` carries texts encoded ahead, off the loop, to the synchronous
admission path that needs them: the request's own task sets it around
admission (a context variable is task-local), so a text is never looked up in
another request's encodings.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")

# Bodies up to this size are parsed and tokenized on the loop (well under a millisecond).
INLINE_BYTES = 8 * 1024

# The texts this task's request encoded ahead (text -> ids); empty outside admission.
_AHEAD: ContextVar[Mapping[str, tuple[int, ...]] | None] = ContextVar(
    "kvfence_encoded_ahead", default=None
)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers() -> int:
    """Half the usable cores (at least one): the engine's step and the loop keep the rest."""
    return max(1, usable_cores() // 2)


class TokenizerPool:
    """At most `workers` tokenizations at once; later ones wait their turn in the pool's queue."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="kvf-tokenize")

    async def run(self, size: int, fn: Callable[[], T]) -> T:
        """`fn()` inline when the input is small (`size` bytes), else in the pool."""
        if size <= INLINE_BYTES:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def encoded_ahead(text: str) -> tuple[int, ...] | None:
    """The ids of `text` if this request encoded it ahead, else None."""
    ahead = _AHEAD.get()
    return None if ahead is None else ahead.get(text)


@contextmanager
def encodings(ahead: Mapping[str, tuple[int, ...]]) -> Iterator[None]:
    """Make `ahead` visible to `encoded_ahead` in this task for the duration of the block."""
    token = _AHEAD.set(ahead)
    try:
        yield
    finally:
        _AHEAD.reset(token)
