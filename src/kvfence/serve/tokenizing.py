"""Tokenizing off the event loop, in a pool bounded by the machine's cores.

Encoding a prompt and rendering a chat template cost about a microsecond per
character: on the event loop, one large prompt would stall every other
tenant's requests (their admission, their streamed tokens) for as long. Work
above `INLINE_BYTES` of body therefore runs in a thread pool sized to the
usable cores, the bound on how much of the machine tokenizing can take
(half of them: the engine's step and the event loop keep the rest). The
encoding itself goes through `tokenizers`' batch entry point, which releases
the GIL while it works; its single-text `encode` holds it throughout (about a
second for a 1 MB prompt), which would stall the loop from any thread. Small bodies are tokenized inline: their cost is below a thread hop's
and they never queue behind a large one.

`encodings` carries texts encoded ahead, off the loop, to the synchronous
admission path that needs them (their ids, or the refusal of a text over the
context): the request's own task sets it around
admission (a context variable is task-local), so a text is never looked up in
another request's encodings.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from tokenizers import Encoding

from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.errors import ApiError

T = TypeVar("T")
# A text's ids, or the refusal its encoding earned (a prompt over the context), kept so the
# synchronous path raises it without encoding the text again.
Encoded = tuple[int, ...] | ApiError

# How much lower than the server's other threads the pool's run (a nice increment).
NICENESS = 10
# Bodies up to this size are parsed and tokenized on the loop (well under a millisecond).
INLINE_BYTES = 8 * 1024

# The texts this task's request encoded ahead (text -> ids); empty outside admission.
_AHEAD: ContextVar[Mapping[str, Encoded] | None] = ContextVar("kvfence_encoded_ahead", default=None)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers() -> int:
    """Half the usable cores (at least one): the engine's step and the loop keep the rest."""
    return max(1, usable_cores() // 2)


class TokenizerPool:
    """At most `workers` tokenizations at once; later ones wait their turn in the pool's queue."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or default_workers()
        self._executor = ThreadPoolExecutor(
            self.workers, thread_name_prefix="kvf-tokenize", initializer=_yield_cpu
        )

    async def run(self, size: int, fn: Callable[[], T]) -> T:
        """`fn()` inline when the input is small (`size` bytes), else in the pool."""
        if size <= INLINE_BYTES:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _yield_cpu() -> None:
    """Run this pool thread below the engine and the loop (Linux nice values are per thread):
    on a busy machine a large prompt waits for a core, not another tenant's step."""
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)


def encode_once(tokenizer: Tokenizer, text: str) -> Encoding:
    """`text` encoded as `tokenizer.encode(text)` does, with the GIL released meanwhile."""
    [encoding] = tokenizer.backend.encode_batch([text], add_special_tokens=False)
    return encoding


def encoded_ahead(text: str) -> Encoded | None:
    """The ids of `text` if this request encoded it ahead, else None."""
    ahead = _AHEAD.get()
    return None if ahead is None else ahead.get(text)


@contextmanager
def encodings(ahead: Mapping[str, Encoded]) -> Iterator[None]:
    """Make `ahead` visible to `encoded_ahead` in this task for the duration of the block."""
    token = _AHEAD.set(ahead)
    try:
        yield
    finally:
        _AHEAD.reset(token)
