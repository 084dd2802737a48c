"""Mixed batches: prefill's chunks and decode's tokens in one forward, same outputs, same fences."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from runtime_helpers import Models, assert_quiet_and_empty, greedy, submit, work

from kvfence.engine.mixed import prefill_budget
from kvfence.kv.pool import KVPool
from kvfence.model.base import CausalLM, ForwardBatch
from kvfence.serve.pipeline import LocalPipeline, Result

# Prompts long enough to be chunked (chunk 24, mid-page), arriving while others decode.
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((30, 70, 9, 110, 45, 61))]


class StepLog:
    """Counts the model's forward steps and how many pools each one covered."""

    def __init__(self, model: CausalLM) -> None:
        self.parts: list[int] = []
        self._inner = model.forward_many

        def counted(parts: Sequence[tuple[ForwardBatch, KVPool]]) -> list[torch.Tensor]:
            self.parts.append(len(parts))
            return self._inner(parts)

        self._model = model
        model.forward_many = counted  # type: ignore[method-assign]

    def restore(self) -> None:
        del self._model.forward_many


def staggered(pipe: LocalPipeline, every: int = 3) -> list[Result]:
    """Submit one prompt every `every` engine iterations, so prefill and decode overlap."""
    sinks = []
    for i, p in enumerate(PROMPTS):
        sinks += submit(pipe, [work(f"r{i}", f"t{i % 3}", p, greedy(12, logprobs=2))])
        for _ in range(every):
            pipe.pump()
    pipe.drive()
    return [s.wait(0) for s in sinks]


def run_llama(models: Models, mixed: bool) -> tuple[list[Result], list[int]]:
    pipe = models.pipeline("llama", chunk_size=24, max_batch_tokens=64, mixed_batches=mixed)
    log = StepLog(models.llama)
    try:
        results = staggered(pipe)
    finally:
        log.restore()
    assert all(r.error is None for r in results)
    assert_quiet_and_empty(pipe)
    return results, log.parts


def test_mixed_batches_give_the_separate_passes_outputs_in_fewer_forwards(models: Models) -> None:
    separate, separate_steps = run_llama(models, mixed=False)
    mixed, mixed_steps = run_llama(models, mixed=True)
    assert [r.token_ids for r in mixed] == [r.token_ids for r in separate]  # greedy: identical
    for a, b in zip(mixed, separate, strict=True):
        for ea, eb in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in ea] == [t for t, _ in eb]
            assert [lp for _, lp in ea] == pytest.approx([lp for _, lp in eb], abs=1e-4)
    assert len({tuple(r.token_ids) for r in mixed}) == len(PROMPTS)  # not trivially alike
    assert set(separate_steps) == {1}  # one pool per forward: weights read twice per step
    assert mixed_steps.count(2) >= 5  # both pools in one forward, many times
    assert len(mixed_steps) < len(separate_steps)


def test_decode_tokens_count_against_the_step_budget(models: Models) -> None:
    pipe = models.pipeline(max_batch_tokens=48, max_running=16)
    submit(pipe, [work(f"d{i}", f"t{i}", list(range(10, 20)), greedy(30)) for i in range(8)])
    for _ in range(10):
        if len(pipe.decode.running) == 8:
            break
        pipe.pump()
    assert len(pipe.decode.running) == 8 and not pipe.prefill.running
    submit(pipe, [work("long", "t-new", list(range(100, 300)), greedy(2))])
    pipe.pump()  # bootstrap at decode, then a mixed step: 8 decode tokens + 40 prompt tokens
    assert pipe.prefill.seqs["long"].computed == 40
    pipe.drive()
    assert_quiet_and_empty(pipe)


def test_prefill_budget_keeps_a_page_however_many_rows_decode(models: Models) -> None:
    config = models.pipeline(max_batch_tokens=64).config
    assert prefill_budget(config, 0) == 64
    assert prefill_budget(config, 20) == 44
    assert prefill_budget(config, 64) == prefill_budget(config, 500) == config.page_size


def test_a_violation_in_a_mixed_step_fails_only_the_offending_row(models: Models) -> None:
    pipe = models.pipeline(chunk_size=16, max_batch_tokens=32)
    good_prompt, bad_prompt = list(range(10, 40)), list(range(50, 80))
    good, bad = submit(
        pipe,
        [work("good", "t1", good_prompt, greedy(20)), work("bad", "t2", bad_prompt, greedy(20))],
    )
    for _ in range(4):
        pipe.pump()
    assert {s.req.rid for s in pipe.decode.running} == {"good", "bad"}
    long_prompt = list(range(100, 200))
    (late,) = submit(pipe, [work("late", "t3", long_prompt, greedy(4))])
    pipe.pump()  # "late" is in prefill now, in chunks, while both rows decode
    assert pipe.prefill.running and pipe.prefill.seqs["late"].computed > 0
    page = pipe.decode.seqs["bad"].pages[0].index
    pipe.decode_pool.generation[page] += 1  # its handle is stale now: reads must fail (I1)
    log = StepLog(models.mirror)
    try:
        pipe.pump()  # the mixed step that meets the stale table
    finally:
        log.restore()
    assert log.parts[0] == 2  # the refusal came in a forward over both pools
    pipe.drive()
    assert good.wait(0).token_ids == good_prompt[:20]
    assert late.wait(0).token_ids == long_prompt[:4]  # prefill's rows in that step carried on
    err = bad.wait(0).error
    assert err is not None and err.status == 500 and "isolation violation" in err.message
    assert pipe.stats().counters.isolation_violations == 1
    pipe.check_integrity()
