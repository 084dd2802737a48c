"""Shared helpers for the model tests: a pool with per-request pages, and HF reference logits."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvfence.faults import FaultSet
from kvfence.kv.pool import KVPool, PageHandle
from kvfence.model.base import CausalLM
from kvfence.model.batching import RowSpec, build_forward_batch
from kvfence.model.config import ModelConfig


@dataclass
class Seq:
    """One request's state in a test: owner, pages, tokens so far, generated count."""

    owner: int
    pages: list[PageHandle]
    tokens: list[int]
    cached: int = 0  # tokens whose K/V are in the pool
    generated: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


def make_pool(
    config: ModelConfig, num_pages: int = 64, *, page_size: int = 16, faults: FaultSet | None = None
) -> KVPool:
    return KVPool(config.kv_geometry(page_size), num_pages, faults=faults)


def new_seq(pool: KVPool, prompt: Sequence[int], capacity: int) -> Seq:
    owner = pool.register_owner(f"req-{len(prompt)}")
    return Seq(owner, pool.allocate(owner, pool.geometry.pages_for(capacity)), list(prompt))


def step(
    model: CausalLM, pool: KVPool, work: Sequence[tuple[Seq, int]], *, all_logits: bool = False
) -> torch.Tensor:
    """Run one forward over (seq, n_new) pairs: each seq feeds its next n_new uncached tokens."""
    rows = [
        RowSpec(s.pages, s.owner, s.tokens[s.cached : s.cached + n], s.cached, s.generated)
        for s, n in work
    ]
    out = model(build_forward_batch(pool.page_size, rows, all_logits=all_logits), pool)
    for s, n in work:
        s.cached += n
    return out


def step_many(
    model: CausalLM, parts: Sequence[tuple[KVPool, Sequence[tuple[Seq, int]], bool]]
) -> list[torch.Tensor]:
    """One `forward_many` over (pool, work, all_logits) parts; `step`'s bookkeeping per part."""
    batches = []
    for pool, work, all_logits in parts:
        rows = [
            RowSpec(s.pages, s.owner, s.tokens[s.cached : s.cached + n], s.cached, s.generated)
            for s, n in work
        ]
        batches.append((build_forward_batch(pool.page_size, rows, all_logits=all_logits), pool))
    out = model.forward_many(batches)
    for _, work, _ in parts:
        for s, n in work:
            s.cached += n
    return out


def hf_logits(hf: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """Reference: HF transformers over the whole sequence, no cache. [len, vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([list(tokens)])).logits[0].float()


# A small Llama geometry for the attention kernels' tests; `heads_config` varies its heads.
KERNEL_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=512,
    hidden_size=96,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=64,
)


def heads_config(head_dim: int, heads: int, kv_heads: int) -> ModelConfig:
    return dataclasses.replace(
        KERNEL_CONFIG, hidden_size=heads * head_dim, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim,
    )  # fmt: skip
