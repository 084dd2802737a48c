"""The fused decode step (every layer in one kernel call) is bitwise the per-layer path.

Both models load the same checkpoint into their own pools and run the same
prefill and decode steps; logits and every K/V byte must be equal, not close.
A spy on the layers proves the fused call really ran the decode steps.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from kvmodel_helpers import make_pool, new_seq, step
from test_llama_parity import COMMON, _random_hf_checkpoint

from kvfence.model.base import ForwardBatch
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.llama import DecoderLayer, LlamaModel
from kvfence.model.loader import load_model

VARIANTS = {
    # GQA 4:2, head_dim 32; biases on q/k/v (Qwen2)
    "qwen2": transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    # head_dim 48 (no vector path for the attention kernel), a window shorter than the context
    "mistral": transformers.MistralConfig(**COMMON, sliding_window=8, head_dim=48),
    # every bias (attention and MLP): the kernel's bias pointers
    "llama-bias": transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
}


def _pair(directory: Path) -> tuple[LlamaModel, LlamaModel]:
    fused, per_layer = load_model(directory).model, load_model(directory).model
    assert isinstance(fused, LlamaModel) and isinstance(per_layer, LlamaModel)
    assert fused.fused is not None and fused.fused.has_kernel, "the kernels are not built"
    per_layer.fused = None
    return fused, per_layer


def _run(model: LlamaModel, rows: int, steps: int, vocab: int) -> tuple[list[torch.Tensor], Any]:
    """Prefill `rows` prompts, then `steps` greedy decode steps of every row: the logits, pool."""
    rng = random.Random(rows)
    pool = make_pool(model.config, 160, page_size=4)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 30))] for _ in range(rows)]
    seqs = [new_seq(pool, p, len(p) + steps + 1) for p in prompts]
    out = [step(model, pool, [(s, len(s.tokens)) for s in seqs])]
    for _ in range(steps):
        for s, logits in zip(seqs, out[-1], strict=True):
            s.tokens.append(int(logits.argmax()))
            s.generated += 1
        out.append(step(model, pool, [(s, 1) for s in seqs]))
    return out, pool


def _layer_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    forward = DecoderLayer.forward

    def spy(self: DecoderLayer, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(self.index)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", spy)
    return calls


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_fused_decode_is_bitwise_the_per_layer_path(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    fused, per_layer = _pair(tiny_checkpoint)
    calls = _layer_calls(monkeypatch)
    got, got_pool = _run(fused, rows, 6, fused.config.vocab_size)
    # The prefill step went layer by layer; the six decode steps never called a layer.
    assert len(calls) == fused.config.num_layers
    want, want_pool = _run(per_layer, rows, 6, per_layer.config.vocab_size)
    assert len(calls) == (1 + 7) * per_layer.config.num_layers  # and every step of this one
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got_pool.k, want_pool.k) and torch.equal(got_pool.v, want_pool.v)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fused_decode_matches_per_layer_for_config_variants(
    name: str, tmp_path: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = VARIANTS[name]
    cls = transformers.AutoModelForCausalLM.from_config(config).__class__
    fused, per_layer = _pair(_random_hf_checkpoint(tmp_path, tiny_checkpoint, config, cls))
    calls = _layer_calls(monkeypatch)
    got, got_pool = _run(fused, 5, 12, 512)
    assert len(calls) == fused.config.num_layers  # decode steps fused
    want, want_pool = _run(per_layer, 5, 12, 512)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(got_pool.k, want_pool.k) and torch.equal(got_pool.v, want_pool.v)


def _decode_batch(model: LlamaModel) -> tuple[Any, ForwardBatch]:
    pool = make_pool(model.config, 8, page_size=4)
    seq = new_seq(pool, [1, 2, 3, 4, 5], 8)
    step(model, pool, [(seq, 5)])
    row = RowSpec(seq.pages, seq.owner, [6], 5, 1)
    return pool, build_forward_batch(pool.page_size, [row])


def _fused_run(model: LlamaModel, pool: Any, batch: ForwardBatch) -> torch.Tensor | None:
    assert model.fused is not None
    plan = model.backend.plan(pool, batch, torch.float32)
    x = torch.nn.functional.embedding(batch.input_ids, model.embed)
    freqs = batch.positions.float()[:, None] * model.inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    return model.fused.run(model, x, pool, plan, cos, sin)


def test_fused_decode_refuses_a_slot_or_page_outside_the_pool(tiny_checkpoint: Path) -> None:
    """Past the ledger (a forged batch handed straight to the call): nothing is written."""
    model = load_model(tiny_checkpoint).model
    assert isinstance(model, LlamaModel)
    pool, batch = _decode_batch(model)
    assert _fused_run(model, pool, batch) is not None  # the honest batch runs
    k, v = pool.k.clone(), pool.v.clone()
    outside = pool.num_pages * pool.page_size
    forged = dataclasses.replace(batch, slot_mapping=torch.tensor([outside]))
    with pytest.raises(IndexError, match="slot lies outside the pool"):
        _fused_run(model, pool, forged)
    assert torch.equal(pool.k, k) and torch.equal(pool.v, v)
    pages = batch.pages.pages.clone()
    pages[0, 0] = pool.num_pages
    forged = dataclasses.replace(batch, pages=dataclasses.replace(batch.pages, pages=pages))
    with pytest.raises(ValueError, match="outside the pool"):
        _fused_run(model, pool, forged)
