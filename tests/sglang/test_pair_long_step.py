"""A paired room outlives a prefill step longer than decode's pair wait.

Decode fails a room whose prefill half says nothing for the wait (504
pair_timeout). Prefill says it still holds the room (`Queued`) from a thread
of its own, so one long step -- a long prompt, a host under load -- cannot
silence it. Here both halves are real sides in one process (tiny model, TCP
KV transport, the bootstrap channel over loopback); prefill's model sleeps
before each forward so that its one step lasts three waits.

The word vouches for a live engine, though: a step that outlasts the step
bound is a hung engine, the word stops, and decode fails the room rather
than hold its client for ever.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
from sgl_helpers import room_work, side_pair

from kvfence.engine.messages import Failure, TokenChunk
from kvfence.kv.pool import KVPool
from kvfence.model.base import CausalLM, ForwardBatch
from kvfence.sglang_stack.decode import DecodeSide
from kvfence.sglang_stack.prefill import PrefillSide

WAIT_S = 1.5  # the pair wait, both sides (the default is 30 s); prefill's word every 0.25 s
STEP_S = 3 * WAIT_S  # prefill's one step: three waits long
Sides = tuple[PrefillSide, DecodeSide]


class SlowForward(CausalLM):
    """The real model, each forward started `delay_s` late (a step as long as the test needs)."""

    def __init__(self, inner: CausalLM, delay_s: float) -> None:
        super().__init__()
        self.inner = inner
        self.delay_s = delay_s

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.inner.forward(batch, pool)

    def forward_many(self, parts: Sequence[tuple[ForwardBatch, KVPool]]) -> list[torch.Tensor]:
        time.sleep(self.delay_s)
        return self.inner.forward_many(parts)


def _pair(sgl_checkpoint: Path, step_bound_s: float) -> AbstractContextManager[Sides]:
    return side_pair(
        sgl_checkpoint,
        prefill_model=lambda model: SlowForward(model, STEP_S),
        prefill_options={"pair_timeout_s": WAIT_S, "step_bound_s": step_bound_s},
        decode_options={"pair_timeout_s": WAIT_S},
    )


@pytest.fixture
def pair(sgl_checkpoint: Path) -> Iterator[tuple[PrefillSide, DecodeSide]]:
    with _pair(sgl_checkpoint, step_bound_s=10 * STEP_S) as sides:  # the step is not hung
        yield sides


def test_a_prefill_step_longer_than_the_pair_wait_does_not_expire_the_room(
    pair: tuple[PrefillSide, DecodeSide],
) -> None:
    prefill, decode = pair
    work = room_work(prefill.inbox.addr)
    at_prefill: queue.Queue[TokenChunk | Failure] = queue.Queue()
    at_decode: queue.Queue[TokenChunk | Failure] = queue.Queue()
    started = time.monotonic()
    prefill.submit(work, at_prefill.put)
    decode.submit(work, at_decode.put)
    tokens: list[int] = []
    while True:
        event = at_decode.get(timeout=10 * STEP_S)
        assert not isinstance(event, Failure), event  # a 504 pair_timeout before the fix
        tokens += event.token_ids
        if event.finish_reason is not None:
            break
    assert time.monotonic() - started >= STEP_S  # the step really outlasted the wait
    assert tokens == list(range(20, 24)), tokens  # the mirror model echoes the prompt
    first = at_prefill.get(timeout=10)
    assert isinstance(first, TokenChunk) and first.token_ids == (20,), first


def test_a_hung_prefill_step_stops_the_word_and_decode_fails_the_room(
    sgl_checkpoint: Path,
) -> None:
    """The step bound below the step: the engine looks hung, so decode's wait runs out."""
    with _pair(sgl_checkpoint, step_bound_s=WAIT_S / 2) as (prefill, decode):
        work = room_work(prefill.inbox.addr)
        at_decode: queue.Queue[TokenChunk | Failure] = queue.Queue()
        started = time.monotonic()
        prefill.submit(work, lambda event: None)
        decode.submit(work, at_decode.put)
        event = at_decode.get(timeout=10 * STEP_S)
        waited = time.monotonic() - started
        assert isinstance(event, Failure), event  # tokens: the word went on for a hung engine
        assert event.error.status == 504 and event.error.code == "pair_timeout", event
        assert waited < STEP_S, waited  # decode gave up before the step ended
