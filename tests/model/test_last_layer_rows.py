"""The last layer runs only the tokens whose logits are wanted, and writes every token's K/V.

Against the same model with every layer over every token (the path before the
cut): the logits must agree within float rounding (the cut rows take another
matmul kernel) and every K/V byte of every layer, the last one included, must be
equal, since later steps attend over all of them. A spy on the MLP proves the
last layer really ran on the cut rows only.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvmodel_helpers import Seq, make_pool, new_seq, step, step_many

from kvfence.kv.pool import KVPool
from kvfence.model.linear_cpu import CPULinear
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import load_model

ATOL = 1e-5  # logits of O(1): another kernel's order of sums, not another computation


def _every_layer_over_every_token(
    self: LlamaModel, x: torch.Tensor, steps: Any, keep: torch.Tensor, cos: Any, sin: Any
) -> torch.Tensor:
    for layer in self.layers:
        x = layer(x, self, steps, cos, sin)
    return x[keep]


@pytest.fixture
def mlp_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of rows each `CPULinear.mlp` call ran, in call order."""
    rows: list[int] = []
    mlp = CPULinear.mlp

    def spy(self: CPULinear, x: torch.Tensor, *args: Any) -> torch.Tensor:
        rows.append(int(x.shape[0]))
        return mlp(self, x, *args)

    monkeypatch.setattr(CPULinear, "mlp", spy)
    yield rows


def _model(directory: Path) -> LlamaModel:
    model = load_model(directory).model
    assert isinstance(model, LlamaModel)
    return model


def _prompts(model: LlamaModel, pool: KVPool, lengths: list[int]) -> list[Seq]:
    rng = random.Random(len(lengths))
    vocab = model.config.vocab_size
    return [new_seq(pool, [rng.randrange(vocab) for _ in range(n)], n + 4) for n in lengths]


def _mixed_run(model: LlamaModel) -> tuple[list[torch.Tensor], KVPool, KVPool]:
    """Prefill three prompts (one in two chunks), then one step: prefill's chunk and two
    decode rows in another pool, in one forward."""
    prefill, decode = (
        make_pool(model.config, 64, page_size=4),
        make_pool(model.config, 64, page_size=4),
    )
    a, b, c = _prompts(model, prefill, [23, 5, 40])
    out = [step(model, prefill, [(a, 23), (b, 5), (c, 17)])]
    d, e = _prompts(model, decode, [9, 30])
    out.append(step(model, decode, [(d, 9), (e, 30)]))
    for s, logits in zip((d, e), out[-1], strict=True):
        s.tokens.append(int(logits.argmax()))
    out += step_many(model, [(decode, [(d, 1), (e, 1)], False), (prefill, [(c, 23)], False)])
    return out, prefill, decode


def test_last_layer_runs_only_the_rows_that_reach_the_head(
    tiny_checkpoint: Path, mlp_rows: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(tiny_checkpoint)
    layers = model.config.num_layers
    got, got_prefill, got_decode = _mixed_run(model)
    # Per step: every layer but the last over all its tokens, the last over one token a row.
    assert mlp_rows == [45] * (layers - 1) + [3] + [39] * (layers - 1) + [2] + [25] * (
        layers - 1
    ) + [3]
    monkeypatch.setattr(LlamaModel, "_layers", _every_layer_over_every_token)
    want, want_prefill, want_decode = _mixed_run(_model(tiny_checkpoint))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert (g - w).abs().max() <= ATOL
    for g_pool, w_pool in ((got_prefill, want_prefill), (got_decode, want_decode)):
        assert torch.equal(g_pool.k, w_pool.k) and torch.equal(g_pool.v, w_pool.v)


def test_a_step_that_wants_every_tokens_logits_runs_the_last_layer_whole(
    tiny_checkpoint: Path, mlp_rows: list[int]
) -> None:
    model = _model(tiny_checkpoint)
    pool = make_pool(model.config, 32, page_size=4)
    (seq,) = _prompts(model, pool, [21])
    logits = step(model, pool, [(seq, 21)], all_logits=True)
    assert logits.shape[0] == 21 and mlp_rows == [21] * model.config.num_layers
