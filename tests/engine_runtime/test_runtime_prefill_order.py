"""Prefill admission order: shortest first, the overtaking bound, the tenant-newcomer rule."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from runtime_helpers import PAGE, Models, assert_quiet_and_empty, greedy, submit, work

from kvfence.engine.prefill_order import PrefillOrder
from kvfence.engine.request import RequestState
from kvfence.serve.pipeline import CollectingSink, LocalPipeline


def admitted_at(pipe: LocalPipeline, rooms: Sequence[str], limit: int = 200) -> dict[str, int]:
    """Pump until every room has left prefill's queue; the pump index each one left it at."""
    seen: dict[str, int] = {}
    for i in range(limit):
        pipe.pump()
        for room in rooms:
            seq = pipe.prefill.seqs.get(room)
            if room not in seen and (seq is None or seq.req.state is not RequestState.WAITING):
                seen[room] = i
        if len(seen) == len(rooms):
            return seen
    raise AssertionError(f"still queued after {limit} steps: {set(rooms) - set(seen)}")


def first_token_order(pipe: LocalPipeline, sinks: dict[str, CollectingSink]) -> list[str]:
    """Pump step by step; the rooms in the order their first tokens arrived."""
    order: list[str] = []
    for _ in range(400):
        pipe.pump()
        order += [r for r, s in sinks.items() if r not in order and s.events]
        if len(order) == len(sinks):
            return order
    raise AssertionError(f"no first token after 400 steps: {set(sinks) - set(order)}")


def burst(
    models: Models, order: PrefillOrder, lengths: dict[str, int]
) -> tuple[LocalPipeline, dict[str, CollectingSink]]:
    """One tenant's prompts submitted at once to a pipeline whose steps hold 2 pages of prompt."""
    pipe = models.pipeline(
        max_batch_tokens=2 * PAGE, chunk_size=2 * PAGE, prefill_order=order, mixed_batches=False
    )
    works = [work(r, "t", list(range(3, 3 + n)), greedy(2)) for r, n in lengths.items()]
    return pipe, dict(zip(lengths, submit(pipe, works), strict=True))


LENGTHS = {"long": 6 * PAGE, "short": PAGE // 2, "medium": 3 * PAGE}


def test_shortest_prompt_answers_first(models: Models) -> None:
    pipe, sinks = burst(models, PrefillOrder.SHORTEST, LENGTHS)
    assert first_token_order(pipe, sinks) == ["short", "medium", "long"]
    pipe.drive()
    assert_quiet_and_empty(pipe)


def test_arrival_order_is_kept_when_asked(models: Models) -> None:
    pipe, sinks = burst(models, PrefillOrder.ARRIVAL, LENGTHS)
    assert first_token_order(pipe, sinks)[0] == "long"
    pipe.drive()
    assert_quiet_and_empty(pipe)


@pytest.mark.parametrize("bound", [0, 2, 3])
def test_no_prompt_is_overtaken_more_than_the_bound(models: Models, bound: int) -> None:
    """A long prompt ahead of a stream of short ones is admitted after `bound` of them."""
    pipe = models.pipeline(
        max_batch_tokens=PAGE, chunk_size=PAGE, max_overtakes=bound, mixed_batches=False
    )
    shorts = [f"s{i}" for i in range(6)]
    submit(pipe, [work("long", "t", list(range(3, 3 + 4 * PAGE)), greedy(2))])
    submit(pipe, [work(r, "t", [7] * PAGE, greedy(2)) for r in shorts])
    at = admitted_at(pipe, ["long", *shorts])
    overtook = [r for r in shorts if at[r] < at["long"]]
    assert overtook == shorts[:bound]
    pipe.drive()
    assert_quiet_and_empty(pipe)


def test_a_new_tenant_goes_first_alone(models: Models) -> None:
    """Tenant u's short prompt, arriving mid-way through t's long one, runs the next step alone."""
    pipe = models.pipeline(max_batch_tokens=PAGE, chunk_size=PAGE, mixed_batches=False)
    submit(pipe, [work("long", "t", list(range(3, 3 + 6 * PAGE)), greedy(2))])
    pipe.pump()
    computed = pipe.prefill.seqs["long"].computed
    (u_sink,) = submit(pipe, [work("u1", "u", [9] * (PAGE // 2), greedy(2))])
    pipe.pump()
    assert pipe.prefill.seqs["long"].computed == computed  # t's chunk waited a step
    assert pipe.prefill.seqs.get("u1") is None or pipe.prefill.seqs["u1"].req.state not in (
        RequestState.WAITING,
        RequestState.PREFILLING,
    )
    pipe.drive()
    assert u_sink.wait(0).error is None
    assert_quiet_and_empty(pipe)


def test_a_new_tenant_waiting_for_pages_does_not_stall_the_running_prompt(
    models: Models,
) -> None:
    """The newcomer rule must not livelock: u's prompt needs pages t's running prompt holds."""
    pipe = models.pipeline(prefill_pages=8, decode_pages=24, chunk_size=PAGE, max_batch_tokens=PAGE)
    (t_sink,) = submit(pipe, [work("b", "t", list(range(5, 5 + 8 * PAGE)), greedy(4))])
    pipe.pump()  # t's prompt holds all 8 prefill pages
    (u_sink,) = submit(pipe, [work("v", "u", list(range(200, 230)), greedy(4))])
    pipe.drive(max_iterations=500)
    assert t_sink.wait(0).error is None
    assert u_sink.wait(0).error is None
    assert_quiet_and_empty(pipe)
