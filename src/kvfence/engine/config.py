"""The engine's validated configuration (one object for the prefill and decode engines)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvfence.engine.prefill_order import PrefillOrder
from kvfence.kv.scrub import ScrubPolicy


def default_of(cls: type, name: str) -> Any:
    """A dataclass field's default: CLIs and builders read theirs from the config, never retype it."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is dataclasses.MISSING:
        raise ValueError(f"{cls.__name__}.{name} has no default")
    return field.default


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Pool sizes per role, batching limits and isolation policy.

    prefill_pages / decode_pages: KV pages in each role's pool (each role owns
    its pool; the in-process pipeline copies KV between them).
    max_batch_tokens: new tokens one prefill step may compute (the step budget).
    chunk_size: the most tokens of one prompt computed in one step; longer
    prompts are prefilled in chunks (None = max_batch_tokens).
    prefill_order: the order waiting prompts are admitted in: shortest first
    (the default) or arrival order (`engine/prefill_order.py`).
    max_overtakes: under shortest first, no prompt is overtaken by more than
    this many later arrivals (0 makes it arrival order).
    max_running: decode rows per step.
    context_length: prompt + output tokens one request may reach.
    shared_prefix_namespace: the operator's explicit opt-in to cross-tenant
    prefix sharing (I8); None (the default) keeps each tenant's cache apart.
    eos_token_ids: tokens that end generation unless a request sets ignore_eos.
    mixed_batches: the in-process pipeline runs prefill's chunks and decode's
    tokens as one forward per step (decode's tokens count against
    max_batch_tokens first), so the weights are read once for both; False runs
    them as two forwards (the reference the mixed path is tested against).
    """

    prefill_pages: int
    decode_pages: int
    page_size: int = 16
    max_batch_tokens: int = 512
    chunk_size: int | None = None
    prefill_order: PrefillOrder = PrefillOrder.SHORTEST
    max_overtakes: int = 16
    max_running: int = 64
    context_length: int = 4096
    scrub: ScrubPolicy = ScrubPolicy.NONE
    prefix_cache: bool = True
    shared_prefix_namespace: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    sampler_seed: int | None = None
    mixed_batches: bool = True

    def __post_init__(self) -> None:
        for name in ("prefill_pages", "decode_pages", "page_size", "max_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        for name in ("max_running", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_overtakes, int) or self.max_overtakes < 0:
            raise ValueError(
                f"EngineConfig.max_overtakes must be an integer >= 0, got {self.max_overtakes!r}"
            )
        if not isinstance(self.prefill_order, PrefillOrder):
            raise ValueError(
                f"EngineConfig.prefill_order must be a PrefillOrder, got {self.prefill_order!r}"
            )
        if self.chunk_size is not None and not 0 < self.chunk_size <= self.max_batch_tokens:
            raise ValueError(
                f"EngineConfig.chunk_size must be in [1, max_batch_tokens={self.max_batch_tokens}], "
                f"got {self.chunk_size}"
            )
        if self.shared_prefix_namespace == "":
            raise ValueError(
                "EngineConfig.shared_prefix_namespace must be None or a non-empty name"
            )

    @property
    def step_chunk(self) -> int:
        return self.chunk_size or self.max_batch_tokens
