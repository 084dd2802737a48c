"""Shared helpers for the engine runtime tests: tiny models, pipelines, running requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvfence.engine.backend import GenerateWork
from kvfence.engine.config import EngineConfig
from kvfence.engine.messages import SamplingParams
from kvfence.faults import FaultSet
from kvfence.model.base import CausalLM
from kvfence.model.config import ModelConfig
from kvfence.model.loader import load_model
from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.serve.pipeline import CollectingSink, LocalPipeline, Result
from kvfence.transfer.link import inprocess_link

PAGE = 16


class Models:
    def __init__(self, directory: Path) -> None:
        make_tiny_checkpoint(directory)
        mirror = load_model(directory, kind="mirror")
        llama = load_model(directory, kind="llama")
        self.config: ModelConfig = mirror.config
        self.mirror: CausalLM = mirror.model
        self.llama: CausalLM = llama.model

    def pipeline(
        self,
        kind: str = "mirror",
        faults: FaultSet | None = None,
        **overrides: object,
    ) -> LocalPipeline:
        base = EngineConfig(prefill_pages=64, decode_pages=128, page_size=PAGE)
        config = replace(base, **overrides)  # type: ignore[arg-type]
        model = self.mirror if kind == "mirror" else self.llama
        geometry = self.config.kv_geometry(page_size=PAGE)
        return LocalPipeline(model, geometry, config, faults, kv_link=inprocess_link)


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def work(
    room: str,
    tenant: str,
    prompt: Sequence[int],
    sampling: SamplingParams,
    namespace: str | None = None,
) -> GenerateWork:
    return GenerateWork(room, tenant, tuple(prompt), sampling, namespace or tenant)


def submit(pipe: LocalPipeline, works: Sequence[GenerateWork]) -> list[CollectingSink]:
    sinks = []
    for w in works:
        sink = CollectingSink()
        pipe.submit(w, sink)
        sinks.append(sink)
    return sinks


def run(pipe: LocalPipeline, works: Sequence[GenerateWork]) -> list[Result]:
    """Run `works` to completion on the caller's thread (deterministic scheduling)."""
    sinks = submit(pipe, works)
    pipe.drive()
    return [s.wait(0) for s in sinks]


def assert_quiet_and_empty(pipe: LocalPipeline) -> None:
    """Ledgers consistent; with the prefix cache emptied, every page of both pools is free;
    neither role still holds a room (a coordinator runs its ledger check only when not busy)."""
    assert pipe.prefill_role.open_rooms() == [] and not pipe.prefill_role.busy
    assert pipe.decode_role.open_rooms() == [] and not pipe.decode_role.busy
    pipe.check_integrity()
    pipe.clear_prefix_cache()
    pipe.check_integrity()
    for pool in (pipe.prefill_pool, pipe.decode_pool):
        assert pool.num_free == pool.num_pages, (pool.num_used, pool.num_pending)
