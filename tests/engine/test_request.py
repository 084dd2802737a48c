"""Request lifecycle: distinct terminal states, allow-list admission (I2), one ending (I6)."""

from __future__ import annotations

import pytest

from kvfence.engine.request import (
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    Request,
    RequestError,
    RequestState,
)

S = RequestState
OVERLONG = RequestError(
    400, "invalid_request_error", "prompt of 700,000 tokens exceeds the pool's 681,280", "messages"
)


def request(prompt_len: int = 8) -> Request:
    return Request(rid="r1", tenant="tenant-a", prompt_ids=tuple(range(prompt_len)), max_tokens=4)


def prefill_admits(req: Request) -> bool:
    """The allow-list admission the engine uses (I2): only a request waiting for prefill."""
    return req.state is S.PREFILLING


def legacy_admits(req: Request) -> bool:
    """SGLang's pre-fix admission: anything `finished()` does not call finished."""
    return not req.legacy_finished()


def test_pd_happy_path_on_both_sides() -> None:
    decode = request()
    for state in (S.BOOTSTRAPPING, S.TRANSFERRING, S.DECODING):
        decode.advance(state)
    decode.finish("length")
    assert decode.history == [S.WAITING, S.BOOTSTRAPPING, S.TRANSFERRING, S.DECODING, S.FINISHED]
    assert (decode.finish_reason, decode.error, decode.terminal) == ("length", None, True)
    prefill = request()
    prefill.advance(S.PREFILLING)
    prefill.advance(S.TRANSFERRING)
    prefill.advance(S.FINISHED)  # prefill's part is done
    assert prefill.terminal and prefill.finish_reason is None


def test_terminal_states_are_distinct_and_final() -> None:
    assert {S.FINISHED, S.REJECTED, S.ABORTED, S.FAILED} == TERMINAL
    assert all(not TRANSITIONS[s] for s in TERMINAL)
    assert all(s.terminal is (s in TERMINAL) for s in S)


def test_reject_keeps_the_original_error_and_the_prompt() -> None:
    req = request(8)
    prompt = req.prompt_ids
    req.reject(OVERLONG)
    assert req.state is S.REJECTED and req.state is not S.FINISHED
    assert req.error is OVERLONG
    assert req.prompt_ids == prompt and req.num_prompt_tokens == 8  # no 1-token placeholder
    assert req.finish_reason is None and req.to_finish is None


@pytest.mark.parametrize("end", ["finish", "reject", "abort", "fail"])
@pytest.mark.parametrize("again", ["finish", "reject", "abort", "fail"])
def test_a_second_ending_raises_and_changes_nothing(end: str, again: str) -> None:
    req = request()
    if end == "finish":
        req.advance(S.PREFILLING)
        req.advance(S.DECODING)
        req.finish("stop")
    else:
        getattr(req, end)(OVERLONG)
    snapshot = (req.state, req.error, req.finish_reason, list(req.history))
    other = RequestError(500, "internal_error", "second ending")
    with pytest.raises(IllegalTransition):
        if again == "finish":
            req.finish("stop")
        else:
            getattr(req, again)(other)
    assert (req.state, req.error, req.finish_reason, list(req.history)) == snapshot


@pytest.mark.parametrize("state", [S.REJECTED, S.ABORTED, S.FAILED])
def test_error_endings_cannot_be_reached_without_an_error(state: RequestState) -> None:
    req = request()
    with pytest.raises(IllegalTransition, match="reject/abort/fail"):
        req.advance(state)
    assert req.state is S.WAITING and req.error is None


def test_illegal_moves_raise_and_change_nothing() -> None:
    req = request()
    with pytest.raises(IllegalTransition, match="waiting -> decoding"):
        req.advance(S.DECODING)
    with pytest.raises(IllegalTransition):
        req.finish("stop")  # nothing was generated yet
    req.advance(S.PREFILLING)
    req.advance(S.TRANSFERRING)
    with pytest.raises(IllegalTransition):
        req.reject(OVERLONG)  # rejection happens at admission, not mid-transfer
    with pytest.raises(IllegalTransition):
        req.advance(S.PREFILLING)  # no going back
    assert req.state is S.TRANSFERRING and req.history[-1] is S.TRANSFERRING


def test_finish_reason_is_validated_before_the_move() -> None:
    req = request()
    req.advance(S.PREFILLING)
    req.advance(S.DECODING)
    with pytest.raises(ValueError, match="'stop' or 'length'"):
        req.finish("abort")
    assert req.state is S.DECODING
    req.abort(RequestError(499, "aborted", "client went away"))
    assert req.state is S.ABORTED and req.finish_reason is None


def test_construction_and_error_validation() -> None:
    with pytest.raises(ValueError, match="at least one prompt token"):
        Request(rid="r", tenant="t", prompt_ids=(), max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        Request(rid="r", tenant="t", prompt_ids=(1,), max_tokens=-1)
    with pytest.raises(ValueError, match="4xx or 5xx"):
        RequestError(200, "ok", "a success is not an error")


def test_abort_not_terminal_semantics_admit_a_rejected_request_the_allow_list_refuses() -> None:
    """SGLang #30233: the reject path stored its error aside and left the state alive.

    Under the `abort-not-terminal` semantics (error in `to_finish`, state
    untouched) the legacy `not finished()` predicate admits the rejected
    request; the fix (REJECTED state + allow-list admission) refuses it.
    """
    legacy = request(8)
    legacy.advance(S.PREFILLING)
    legacy.to_finish = OVERLONG  # the legacy reject: error stored aside, state still live
    assert legacy_admits(legacy), "the bug: a rejected request still looks alive"

    fixed = request(8)
    fixed.advance(S.PREFILLING)
    fixed.reject(OVERLONG)
    assert not prefill_admits(fixed)
    assert not legacy_admits(fixed)
    assert fixed.error is OVERLONG


@pytest.mark.parametrize("state", list(S))
def test_allow_list_admits_only_prefilling_while_not_finished_admits_every_live_state(
    state: RequestState,
) -> None:
    """`not finished()` is a deny-list: every non-terminal state passes it, wanted or not."""
    req = request()
    path = {
        S.WAITING: [],
        S.BOOTSTRAPPING: [S.BOOTSTRAPPING],
        S.PREFILLING: [S.PREFILLING],
        S.TRANSFERRING: [S.PREFILLING, S.TRANSFERRING],
        S.DECODING: [S.PREFILLING, S.DECODING],
        S.FINISHED: [S.PREFILLING, S.DECODING, S.FINISHED],
    }
    if state in path:
        for step in path[state]:
            req.advance(step)
    else:
        {S.REJECTED: req.reject, S.ABORTED: req.abort, S.FAILED: req.fail}[state](OVERLONG)
    assert req.state is state
    assert prefill_admits(req) is (state is S.PREFILLING)
    assert legacy_admits(req) is (state not in TERMINAL)
