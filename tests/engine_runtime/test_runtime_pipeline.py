"""The in-process PD pipeline: echoes, chunked prefill, queuing under pressure, aborts."""

from __future__ import annotations

import random

import pytest
from runtime_helpers import PAGE, Models, assert_quiet_and_empty, greedy, run, submit, work

from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import Bootstrap, BootstrapReady, PrefillWork, SamplingParams
from kvfence.engine.request import RequestState
from kvfence.faults import Fault, FaultSet
from kvfence.serve.pipeline import CollectingSink, LocalPipeline


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_every_tenant_gets_its_own_echo(models: Models) -> None:
    pipe = models.pipeline()
    ps = prompts(12)
    works = [work(f"r{i}", f"tenant-{i % 3}", p, greedy(len(p))) for i, p in enumerate(ps)]
    results = run(pipe, works)
    for p, r in zip(ps, results, strict=True):
        assert r.error is None
        assert r.token_ids == p  # the mirror replays exactly the KV it attends: its own prompt
        assert r.finish_reason == "length"
    stats = pipe.stats().counters
    assert stats.finished == 12
    assert stats.generation_tokens == sum(len(p) for p in ps)
    assert stats.isolation_violations == stats.transfer_mismatches == 0
    assert_quiet_and_empty(pipe)


def test_threaded_pipeline_serves_concurrent_submits(models: Models) -> None:
    pipe = models.pipeline()
    pipe.start()
    try:
        ps = prompts(8, seed=1, lo=10)
        sinks = submit(pipe, [work(f"r{i}", f"t{i % 4}", p, greedy(10)) for i, p in enumerate(ps)])
        for p, s in zip(ps, sinks, strict=True):
            r = s.wait(60)
            assert r.token_ids == p[:10]
        assert pipe.wait_idle(60)
    finally:
        pipe.stop()
    assert_quiet_and_empty(pipe)


def test_chunked_prefill_equals_unchunked_on_llama(models: Models) -> None:
    ps = prompts(3, seed=2, lo=60, hi=140)
    outs = []
    for chunk in (None, 24):  # 24: chunk boundaries fall mid-page
        pipe = models.pipeline("llama", chunk_size=chunk, max_batch_tokens=256)
        results = run(pipe, [work(f"r{i}", "t", p, greedy(8)) for i, p in enumerate(ps)])
        outs.append([r.token_ids for r in results])
        assert all(r.error is None for r in results)
        assert_quiet_and_empty(pipe)
    assert outs[0] == outs[1]
    assert len(set(map(tuple, outs[0]))) == 3  # the outputs are not trivially alike


def test_chunking_really_splits_prefill(models: Models) -> None:
    pipe = models.pipeline(chunk_size=16, max_batch_tokens=32)
    p = list(range(10, 110))
    submit(pipe, [work("r", "t", p, greedy(4))])
    pipe.pump()
    seq = pipe.prefill.running[0]
    assert seq.computed == 16  # one chunk per step, not the whole prompt
    pipe.drive()


def test_pool_exhaustion_queues_instead_of_failing(models: Models) -> None:
    # Prefill holds one 100-token prompt at a time, decode two requests at a time.
    pipe = models.pipeline(prefill_pages=8, decode_pages=17, max_running=8, prefix_cache=False)
    ps = [[(i * 37 + j) % 490 + 5 for j in range(100)] for i in range(6)]
    sinks = submit(pipe, [work(f"r{i}", f"t{i}", p, greedy(20)) for i, p in enumerate(ps)])
    pipe.pump()
    assert len(pipe.decode.queued) > 0  # bootstraps wait for pages: nothing partial
    assert pipe.prefill_pool.num_used <= 8
    pipe.drive()
    for p, s in zip(ps, sinks, strict=True):
        r = s.wait(0)
        assert r.error is None and r.token_ids == p[:20]
    assert pipe.stats().counters.failed == 0
    assert_quiet_and_empty(pipe)


def test_prompt_over_decode_pool_fails_at_bootstrap(models: Models) -> None:
    pipe = models.pipeline(decode_pages=4)
    (r,) = run(pipe, [work("r", "t", list(range(5, 100)), greedy(2))])
    assert r.error is not None and r.error.status == 400
    assert "decode pool holds at most 64 tokens" in r.error.message
    assert_quiet_and_empty(pipe)


def assert_abort_at_stage_leaves_ledger_clean(models: Models, stage: str) -> None:
    """Bring one request to `stage`, abort it, and check it ends once with 499 and frees everything."""
    pipe = models.pipeline(prefill_pages=8, decode_pages=12, chunk_size=16, max_batch_tokens=16)
    blocker = list(range(5, 125))  # 120 tokens: fills decode or prefill for a while
    victim = list(range(200, 300))
    if stage == "decode-queue":
        b_sink, v_sink = submit(
            pipe, [work("b", "t", blocker, greedy(4)), work("v", "u", victim, greedy(4))]
        )
        pipe.pump()
        assert [s.req.rid for s in pipe.decode.queued] == ["v"]
    elif stage == "prefill-queue":
        (b_sink,) = submit(pipe, [work("b", "t", blocker, greedy(4))])
        pipe.pump()  # the blocker holds every prefill page
        (v_sink,) = submit(pipe, [work("v", "u", victim[:30], greedy(4))])
        pipe.pump()
        assert pipe.prefill.seqs["v"].req.state is RequestState.WAITING
    elif stage == "mid-prefill":
        (v_sink,) = submit(pipe, [work("v", "u", victim, greedy(4))])
        b_sink = None
        pipe.pump()
        assert pipe.prefill.seqs["v"].req.state is RequestState.PREFILLING
        assert pipe.prefill.seqs["v"].computed == 16
    elif stage == "decoding":
        (v_sink,) = submit(pipe, [work("v", "u", victim[:20], greedy(50))])
        b_sink = None
        for _ in range(4):
            pipe.pump()
        assert pipe.decode.seqs["v"].req.state is RequestState.DECODING
    else:
        raise AssertionError(stage)
    pipe.abort("v", "client disconnected")
    pipe.drive()
    r = v_sink.wait(0)
    assert r.error is not None and r.error.status == 499
    assert len([e for e in v_sink.events if e.room == "v" and not hasattr(e, "token_ids")]) == 1
    if b_sink is not None:
        assert b_sink.wait(0).error is None  # the other request is unaffected
    assert pipe.stats().counters.aborted == 1
    assert_quiet_and_empty(pipe)


@pytest.mark.parametrize("stage", ["decode-queue", "prefill-queue", "mid-prefill", "decoding"])
def test_abort_at_every_stage_leaves_the_ledger_clean(models: Models, stage: str) -> None:
    assert_abort_at_stage_leaves_ledger_clean(models, stage)


def test_abort_of_unknown_or_finished_room_is_harmless(models: Models) -> None:
    pipe = models.pipeline()
    (r,) = run(pipe, [work("r", "t", [5, 6, 7], greedy(3))])
    pipe.abort("r", "late")
    pipe.abort("nobody", "typo")
    pipe.drive()
    assert r.token_ids == [5, 6, 7] and pipe.stats().counters.aborted == 0
    assert_quiet_and_empty(pipe)


def test_duplicate_room_is_refused(models: Models) -> None:
    pipe = models.pipeline()
    a, b = submit(
        pipe, [work("same", "t", [5, 6], greedy(4)), work("same", "u", [7, 8], greedy(4))]
    )
    pipe.drive()
    assert b.wait(0).error is not None and b.wait(0).error.status == 409  # type: ignore[union-attr]
    assert a.wait(0).token_ids == [5, 6, 5, 6]  # the mirror echoes its own echo after the prompt


def test_stop_tokens_and_eos(models: Models) -> None:
    pipe = models.pipeline(eos_token_ids=(9,))
    p = [5, 6, 7, 8, 9, 10]
    r1, r2, r3 = run(
        pipe,
        [
            work("a", "t", p, greedy(10, stop_token_ids=(7,))),
            work("b", "t", p, SamplingParams(max_tokens=10, temperature=0.0)),
            work("c", "t", p, greedy(6)),
        ],
    )
    assert (r1.token_ids, r1.finish_reason) == ([5, 6, 7], "stop")
    assert (r2.token_ids, r2.finish_reason) == ([5, 6, 7, 8, 9], "stop")  # eos ends it
    assert (r3.token_ids, r3.finish_reason) == (p, "length")  # ignore_eos


def test_context_length_ends_generation(models: Models) -> None:
    pipe = models.pipeline(context_length=24)
    (r,) = run(pipe, [work("a", "t", list(range(5, 25)), greedy(50))])
    assert r.finish_reason == "length" and len(r.token_ids) == 4


def test_logprobs_are_reported_per_token(models: Models) -> None:
    pipe = models.pipeline("llama")
    (r,) = run(pipe, [work("a", "t", list(range(5, 40)), greedy(5, logprobs=3))])
    assert len(r.logprobs) == 5
    for token, entry in zip(r.token_ids, r.logprobs, strict=True):
        assert entry[0][0] == token and len(entry) == 4
        assert entry[0][1] == pytest.approx(entry[1][1])  # greedy: the chosen one is the top one
        assert all(lp <= 0.0 for _, lp in entry)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        EngineConfig(prefill_pages=4, decode_pages=4, chunk_size=4096, max_batch_tokens=128)
    with pytest.raises(ValueError, match="prefill_pages"):
        EngineConfig(prefill_pages=0, decode_pages=4)
    with pytest.raises(ValueError, match="shared_prefix_namespace"):
        EngineConfig(prefill_pages=4, decode_pages=4, shared_prefix_namespace="")


def test_sink_sees_exactly_one_end(models: Models) -> None:
    pipe = models.pipeline()
    sink = CollectingSink()
    pipe.submit(work("a", "t", [5, 6, 7], greedy(3)), sink)
    pipe.abort("a", "bye")  # aborted before it ever ran
    pipe.drive()
    assert len(sink.events) == 1 and sink.wait(0).error is not None
    assert_quiet_and_empty(pipe)
    assert pipe.prefill_pool.page_size == PAGE


def test_decode_rows_hold_and_the_newest_fails_when_no_row_can_grow(models: Models) -> None:
    # 4 decode pages: two 30-token prompts take 2 pages each and both need a third.
    pipe = models.pipeline(decode_pages=4, prefix_cache=False)
    first, second = list(range(10, 40)), list(range(60, 90))
    r1, r2 = run(pipe, [work("old", "t", first, greedy(20)), work("new", "u", second, greedy(20))])
    assert r1.error is None and r1.token_ids == first[:20]
    assert r2.error is not None and r2.error.status == 503
    assert set(r2.token_ids) <= set(second)  # what it streamed before failing was its own
    assert pipe.decode.counters.preempted == 1
    assert_quiet_and_empty(pipe)


def _reserved_then_aborted(models: Models, faults: FaultSet) -> LocalPipeline:
    pipe = models.pipeline(faults=faults)
    ready = pipe.decode.bootstrap(
        Bootstrap("r", "t", num_prompt_tokens=40, max_tokens=4, sampling=greedy(4))
    )
    assert isinstance(ready, BootstrapReady) and len(ready.pages) == 3
    pipe.decode.abort("r", "client gone")  # the transfer may still land in these pages
    return pipe


def test_abort_defers_release_until_the_transfer_window_closes(models: Models) -> None:
    pipe = _reserved_then_aborted(models, FaultSet())
    assert pipe.decode_pool.num_pending == 3 and pipe.decode_pool.num_free == 128 - 3  # I7
    pipe.pump()  # the transport confirms the cancelled room: the window closes
    assert pipe.decode_pool.num_free == 128
    assert_quiet_and_empty(pipe)


def test_early_free_switch_reuses_pages_a_transfer_may_still_hit(models: Models) -> None:
    pipe = _reserved_then_aborted(models, FaultSet.of(Fault.EARLY_FREE))
    assert pipe.decode_pool.num_pending == 0 and pipe.decode_pool.num_free == 128


def test_decode_refuses_a_bootstrap_it_cannot_honour(models: Models) -> None:
    pipe = models.pipeline()
    bad = pipe.decode.bootstrap(Bootstrap("r", "t", num_prompt_tokens=0, max_tokens=4))
    assert not isinstance(bad, BootstrapReady) and bad is not None
    assert bad.error.status == 400
    assert_quiet_and_empty(pipe)


def test_prefill_keeps_pages_until_the_transport_confirms(models: Models) -> None:
    pipe = models.pipeline(prefix_cache=False)
    prefill = pipe.prefill
    prefill.submit(PrefillWork("r", "t", tuple(range(5, 45)), greedy(4), (), "t"))
    prefill.step()
    (transfer,) = prefill.drain().transfers
    assert len(transfer.src_pages) == 3 and pipe.prefill_pool.num_used == 3
    prefill.abort("r", "client gone")  # the KV may be on the wire: nothing is freed yet (I7)
    assert pipe.prefill_pool.num_used == 3
    prefill.transfer_done("r", ok=False)
    assert pipe.prefill_pool.num_free == pipe.prefill_pool.num_pages
    pipe.check_integrity()
