"""One request that makes a shared step raise fails alone; an engine fault breaks the engine honestly.

The step's rows share a forward and a sampler call. A row that makes either
raise is run again alone and fails with its own error; the step's other rows
finish with exactly the tokens they get when they run by themselves, and no
page is left held. Only when every row raises alone and a probe of no request
raises too is it the engine's fault: every open request fails with a message
that carries no request's error, /health's reason is set, and later requests
are a 503 at once instead of waiting on a dead thread.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from runtime_helpers import Models, assert_quiet_and_empty, greedy, run, submit, work

from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import (
    Bootstrap,
    MessageError,
    SamplingParams,
    decode_message,
    encode_message,
)
from kvfence.faults import POISON_SEED, Fault, FaultSet
from kvfence.model.loader import load_model
from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.serve.pipeline import LocalPipeline, Result
from kvfence.transfer.link import inprocess_link

PROMPTS = {"a0": [5, 6, 7], "b0": [8, 9, 10, 11], "b1": [12, 13], "b2": [14, 15, 16, 17, 18]}
POISONED = "a-poisoned"
OUT_OF_VOCAB = 10**6  # the tiny model's vocabulary has 512 ids: its embedding lookup raises


def solo(models: Models, kind: str, room: str, max_tokens: int) -> list[int]:
    """What `room`'s prompt gives when it runs by itself on a fresh pipeline."""
    [r] = run(models.pipeline(kind), [work(room, "x", PROMPTS[room], greedy(max_tokens))])
    assert r.error is None, r.error
    return r.token_ids


def poisoned(from_token: int) -> SamplingParams:
    """Under `poisoned-sampling`, the draw of output token `from_token` and later ones raise."""
    seed = POISON_SEED + from_token
    return SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)


def assert_alone(results: dict[str, Result], bad: str, own_words: str) -> None:
    error = results[bad].error
    assert error is not None and error.status == 500, results[bad]
    assert own_words in error.message, error.message
    for room, r in results.items():
        if room != bad:
            assert r.error is None, f"{room} failed with another request's error: {r.error}"


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "two-forwards"])
def test_a_request_whose_sampling_raises_fails_alone_in_its_prefill_step(
    models: Models, mixed: bool
) -> None:
    pipe = models.pipeline(faults=FaultSet.of(Fault.POISONED_SAMPLING), mixed_batches=mixed)
    rooms = [*PROMPTS, POISONED]
    works = [work(r, r[0], PROMPTS[r], greedy(6)) for r in PROMPTS]
    works.append(work(POISONED, "a", [20, 21, 22], poisoned(0)))
    sinks = dict(zip(rooms, submit(pipe, works), strict=True))
    pipe.pump()  # one iteration: every prompt is prefilled in this one step
    prompt_tokens = sum(len(w.prompt_ids) for w in works)
    assert pipe.prefill.counters.computed_tokens == prompt_tokens, "not one step"
    assert sinks[POISONED].events  # failed alone in the step, at once
    pipe.drive()
    results = {r: s.wait(0) for r, s in sinks.items()}
    assert_alone(results, POISONED, "poisoned-sampling")
    for room in PROMPTS:
        assert results[room].token_ids == solo(models, "mirror", room, 6), room
    assert pipe.health() is None
    assert_quiet_and_empty(pipe)


def test_a_request_whose_sampling_raises_fails_alone_among_decoding_rows(models: Models) -> None:
    pipe = models.pipeline(faults=FaultSet.of(Fault.POISONED_SAMPLING))
    works = [work(r, r[0], PROMPTS[r], greedy(6)) for r in PROMPTS]
    works.append(work(POISONED, "a", [20, 21, 22], poisoned(1)))  # prefill draws token 0
    sinks = dict(zip([*PROMPTS, POISONED], submit(pipe, works), strict=True))
    pipe.drive()
    results = {r: s.wait(0) for r, s in sinks.items()}
    assert_alone(results, POISONED, "poisoned-sampling")
    assert len(results[POISONED].token_ids) == 1  # its first token came; decode's draw raised
    for room in PROMPTS:
        assert results[room].token_ids == solo(models, "mirror", room, 6), room
    assert_quiet_and_empty(pipe)


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "two-forwards"])
def test_a_request_that_makes_the_forward_raise_fails_alone(models: Models, mixed: bool) -> None:
    pipe = models.pipeline("llama", mixed_batches=mixed)
    works = [work(r, r[0], PROMPTS[r], greedy(5)) for r in PROMPTS]
    works.append(work("a-bad", "a", [3, OUT_OF_VOCAB, 4], greedy(5)))
    results = dict(zip([*PROMPTS, "a-bad"], run(pipe, works), strict=True))
    assert_alone(results, "a-bad", "IndexError")
    for room in PROMPTS:
        assert results[room].token_ids == solo(models, "llama", room, 5), room
    assert pipe.health() is None
    assert_quiet_and_empty(pipe)


def test_several_bad_requests_in_one_step_do_not_take_the_engine_down(models: Models) -> None:
    """Every row raising alone is not an engine fault while the probe runs: no 503 for all."""
    pipe = models.pipeline("llama")
    bad = [work(f"bad{i}", "a", [3, OUT_OF_VOCAB + i], greedy(3)) for i in range(3)]
    for r in run(pipe, bad):
        assert r.error is not None and "IndexError" in r.error.message, r
    assert pipe.health() is None
    [good] = run(pipe, [work("b0", "b", PROMPTS["b0"], greedy(5))])
    assert good.error is None and good.token_ids == solo(models, "llama", "b0", 5)
    assert_quiet_and_empty(pipe)


def test_an_engine_fault_fails_open_requests_generically_and_new_ones_at_once(
    tmp_path: Path,
) -> None:
    """A model that cannot run anything: no request is blamed, health says so, no one waits."""
    make_tiny_checkpoint(tmp_path / "tiny")
    loaded = load_model(tmp_path / "tiny", kind="llama")
    model = loaded.model
    model.embed = torch.nn.Parameter(torch.empty(0, loaded.config.hidden_size))  # type: ignore[assignment]
    geometry = loaded.config.kv_geometry(page_size=16)
    config = EngineConfig(prefill_pages=64, decode_pages=128, page_size=16)
    pipe = LocalPipeline(model, geometry, config, kv_link=inprocess_link)
    pipe.start()
    try:
        sinks = submit(pipe, [work(r, r[0], PROMPTS[r], greedy(3)) for r in PROMPTS])
        for s in sinks:
            error = s.wait(60).error
            assert error is not None and error.status == 500
            assert "IndexError" not in error.message and "index out of range" not in error.message
        assert pipe.health() is not None
        [late] = submit(pipe, [work("late", "b", [1, 2], greedy(2))])
        error = late.wait(30).error  # a request after the fault is answered, not left waiting
        assert error is not None and error.status == 503, error
        assert pipe._thread is not None and pipe._thread.is_alive()
    finally:
        pipe.stop()


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", 2**63),
        ("top_k", 2**31),
        ("top_k", -1),
        ("seed", -1),
        ("seed", 2**63),
        ("max_tokens", 0),
        ("max_tokens", 2**31),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 1e308),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", math.nan),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", (2**63,)),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_sampling_params_refuse_what_the_engine_cannot_run(field: str, value: object) -> None:
    with pytest.raises(MessageError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    # The same value in a message from a peer is refused on receipt, not in a step.
    body = json.loads(encode_message(Bootstrap("r", "t", 3, 4)))
    body["body"]["sampling"][field] = list(value) if isinstance(value, tuple) else value
    with pytest.raises(MessageError):
        decode_message(json.dumps(body).encode())


def test_sampling_params_take_their_whole_range() -> None:
    """Each bound itself is accepted (the refusals above are not off by one)."""
    high = SamplingParams(top_k=2**31 - 1, seed=2**63 - 1, max_tokens=2**31 - 1, temperature=-0.0)
    assert (high.top_k, high.seed, high.max_tokens) == (2**31 - 1, 2**63 - 1, 2**31 - 1)
    low = SamplingParams(seed=0, top_k=0, stop_token_ids=(0, 2**63 - 1), logprobs=20, top_p=1.0)
    assert (low.seed, low.top_k, low.stop_token_ids, low.logprobs) == (0, 0, (0, 2**63 - 1), 20)


def test_the_http_edge_and_the_engine_bound_sampling_alike() -> None:
    """The edge's 400s name the engine's limits (the edge may be stricter, never looser)."""
    from kvfence.engine import messages
    from kvfence.serve import fields, protocol

    assert protocol.MAX_TOP_K == messages.MAX_TOP_K
    assert fields.SEED_RANGE == messages.SEED_RANGE
    assert fields.MAX_LOGPROBS == messages.MAX_LOGPROBS
    assert fields.MAX_TEMPERATURE <= messages.MAX_SAMPLING_TEMPERATURE


def test_a_prompt_that_makes_the_mixed_forward_raise_fails_alone_beside_decoding_rows(
    models: Models,
) -> None:
    """The bad prompt's chunk shares one forward with decode's rows (`forward_together`)."""
    pipe = models.pipeline("llama", mixed_batches=True)
    sinks = dict(
        zip(
            PROMPTS,
            submit(pipe, [work(r, r[0], PROMPTS[r], greedy(8)) for r in PROMPTS]),
            strict=True,
        )
    )
    while not all(s.events for s in sinks.values()):
        pipe.pump()  # until every good request has its first token: decode holds their rows
    assert pipe.decode.running and not pipe.prefill.running
    [bad] = submit(pipe, [work("a-bad", "a", [3, OUT_OF_VOCAB, 4], greedy(5))])
    pipe.drive()
    error = bad.wait(0).error
    assert error is not None and "IndexError" in error.message, error
    for room, s in sinks.items():
        r = s.wait(0)
        assert r.error is None and r.token_ids == solo(models, "llama", room, 8), (room, r)
    assert_quiet_and_empty(pipe)
