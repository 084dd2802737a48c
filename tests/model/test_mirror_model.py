"""The mirror model echoes exactly what its page tables let it read."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from kvmodel_helpers import Seq, make_pool, new_seq, step

from kvfence.faults import Fault, FaultSet
from kvfence.kv.pool import IsolationViolation, KVPool
from kvfence.model.base import ForwardBatch
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.config import ModelConfig
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model
from kvfence.model.mirror import MirrorModel, decode_ids, encode_ids

CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=256,
)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(CONFIG.vocab_size) for _ in range(n)] for n in lengths]


def _generate(model: MirrorModel, pool: KVPool, seqs: list[Seq], steps: int) -> list[list[int]]:
    out = step(model, pool, [(s, len(s.tokens)) for s in seqs])
    produced: list[list[int]] = [[] for _ in seqs]
    for _ in range(steps):
        for i, s in enumerate(seqs):
            tok = int(out[i].argmax())
            produced[i].append(tok)
            s.tokens.append(tok)
            s.generated += 1
        out = step(model, pool, [(s, 1) for s in seqs])
    return produced


def test_ids_survive_the_kv_encoding_in_every_pool_dtype() -> None:
    ids = torch.tensor([0, 1, 255, 256, 49151, 151_935, 2**24 - 1])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kv = encode_ids(ids, 2, 32).to(dtype)
        assert decode_ids(kv).tolist() == ids.tolist()


def test_batch_echoes_each_request_its_own_prompt() -> None:
    model = MirrorModel(CONFIG)
    pool = make_pool(CONFIG, 32)
    prompts = _prompts([5, 19, 33], seed=1)
    seqs = [new_seq(pool, p, len(p) + 40) for p in prompts]
    produced = _generate(model, pool, seqs, 40)
    for prompt, got in zip(prompts, produced, strict=True):
        # Position k holds prompt[k], then the echo itself: the prompt, cyclically.
        assert got == [prompt[k % len(prompt)] for k in range(40)]


def _forged_decode(faults: FaultSet) -> tuple[list[int], list[int], torch.Tensor]:
    """B's page table names A's first page: the SGLang #30233 shape of a cross-request read."""
    pool = make_pool(CONFIG, 16, faults=faults)
    model = MirrorModel(CONFIG)
    a_prompt, b_prompt = _prompts([20, 20], seed=2)
    a, b = new_seq(pool, a_prompt, 40), new_seq(pool, b_prompt, 40)
    step(model, pool, [(a, 20), (b, 20)])
    forged = [a.pages[0], *b.pages[1:]]
    row = RowSpec(forged, b.owner, [b_prompt[0]], start=20, num_generated=3)
    return a_prompt, b_prompt, model(build_forward_batch(16, [row]), pool)


def test_forged_page_table_leaks_the_other_request_verbatim_without_the_ledger_check() -> None:
    a_prompt, b_prompt, logits = _forged_decode(FaultSet.of(Fault.NO_LEDGER_CHECK))
    assert int(logits[0].argmax()) == a_prompt[3] != b_prompt[3]


def test_forged_page_table_is_refused_by_the_ledger_check() -> None:
    with pytest.raises(IsolationViolation, match="may not read"):
        _forged_decode(FaultSet())


def test_reserved_but_unwritten_positions_are_refused() -> None:
    """8-reserved / 1-written (I1): decode past a hole fails, even though it writes after it."""
    pool = make_pool(CONFIG, 8)
    model = MirrorModel(CONFIG)
    s = new_seq(pool, [7], 40)
    step(model, pool, [(s, 1)])
    row = RowSpec(s.pages, s.owner, [9], start=20, num_generated=1)
    with pytest.raises(IsolationViolation, match="slots written"):
        model(build_forward_batch(16, [row]), pool)
    assert int(pool.written[s.pages[1].index]) == 0  # the write past the hole was not counted


def test_stale_page_after_release_surfaces_old_tokens_only_when_unchecked() -> None:
    """A reader holding pages of a released request sees its tokens iff the ledger check is off."""
    for faults, leaks in ((FaultSet.of(Fault.NO_LEDGER_CHECK), True), (FaultSet(), False)):
        pool = make_pool(CONFIG, 8, faults=faults)
        model = MirrorModel(CONFIG)
        (old,) = _prompts([16], seed=3)
        a = new_seq(pool, old, 16)
        step(model, pool, [(a, 16)])
        pool.release(a.pages)
        b_owner = pool.register_owner("b")
        b_pages = pool.allocate(b_owner, 2)
        # B claims A's released page as its first page and decodes at position 16.
        row = RowSpec([a.pages[0], b_pages[1]], b_owner, [1], start=16, num_generated=5)
        if leaks:
            out = model(build_forward_batch(16, [row]), pool)
            assert int(out[0].argmax()) == old[5]
        else:
            with pytest.raises(IsolationViolation):
                model(build_forward_batch(16, [row]), pool)


def test_mirror_body_runs_the_real_body_and_still_echoes(tiny_checkpoint: Path) -> None:
    """kind mirror-body: the checkpoint's Llama body runs every step that prefills (the real
    prefill cost, signal 3), yet the output is the mirror's echo, so a leak still reads as
    text; a decode-only step (every row has generated) skips it: nothing times decode."""
    loaded = load_model(tiny_checkpoint, kind="mirror-body")
    model = loaded.model
    assert isinstance(model, MirrorModel) and isinstance(model.body, LlamaModel)
    calls: list[int] = []
    body_forward = model.body.forward_many

    def counting(parts: Sequence[tuple[ForwardBatch, KVPool]]) -> list[torch.Tensor]:
        calls.append(sum(int(batch.input_ids.numel()) for batch, _ in parts))
        return body_forward(parts)

    model.body.forward_many = counting  # type: ignore[method-assign]
    pool = make_pool(loaded.config, 32)
    rng = random.Random(3)
    prompts = [[rng.randrange(loaded.config.vocab_size) for _ in range(n)] for n in (7, 40)]
    seqs = [new_seq(pool, p, len(p) + 8) for p in prompts]
    produced = _generate(model, pool, seqs, 8)
    assert produced == [(p + p)[:8] for p in prompts]
    assert calls == [47]  # the prefill of both prompts; the 8 decode steps skip the body
