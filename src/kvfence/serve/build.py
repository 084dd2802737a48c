"""Wiring for the single-process server: spec -> model -> LocalPipeline -> ServeConfig.

The spec (`LocalSpec`) is one frozen value: `ServeOptions.local_spec` derives it
from `kvfence serve`'s options, the lab builds its scaled incident as one.
Pool sizes are given in pages or bytes per role; bytes are turned into whole
pages the way engines do; given neither, from the memory available
(`serve.pool_sizing`). The server's engine facts (scrub policy, prefix-cache
namespacing, transport) are read from the pipeline's own configuration, so
/server_info reports what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvfence.engine.config import EngineConfig, default_of
from kvfence.engine.prefill_order import PrefillOrder
from kvfence.engine.sizing import DEFAULT_HEADROOM
from kvfence.faults import FaultSet
from kvfence.kv.geometry import KVGeometry
from kvfence.kv.pool import ScrubPolicy
from kvfence.model.loader import LoadedModel, load_model
from kvfence.serve.config import ServeConfig
from kvfence.serve.pipeline import LocalPipeline
from kvfence.serve.pool_sizing import ROLES, PoolSizes, available_memory_bytes
from kvfence.serve.specs import SHARED_NAMESPACE
from kvfence.transfer.inprocess import InProcessTransport
from kvfence.transfer.link import inprocess_link


@dataclass(frozen=True, slots=True)
class LocalSpec:
    """What the single process is built from; each default is `kvfence serve`'s."""

    model_dir: Path
    kind: str = "llama"
    context_length: int | None = None  # None: the model's
    pools: PoolSizes = field(default_factory=PoolSizes)
    page_size: int = default_of(EngineConfig, "page_size")
    max_batch_tokens: int = default_of(EngineConfig, "max_batch_tokens")
    chunk_size: int | None = None  # None: max_batch_tokens
    prefill_order: PrefillOrder = PrefillOrder.SHORTEST
    scrub: ScrubPolicy = ScrubPolicy.NONE
    prefix_cache: bool = default_of(EngineConfig, "prefix_cache")
    shared_prefix_cache: bool = False  # the operator's explicit opt-in: one cache for all (I8 off)
    faults: FaultSet = field(default_factory=FaultSet)
    headroom: float = DEFAULT_HEADROOM
    allow_undersized_pool: bool = False
    default_max_tokens: int = default_of(ServeConfig, "default_max_tokens")
    lab_profile: str | None = None  # the lab's profile name, reported by /server_info

    def engine_config(
        self, pages: tuple[int, int], context: int, eos: tuple[int, ...]
    ) -> EngineConfig:
        """The engines' config, given (prefill, decode) pages, the context and the model's EOS."""
        return EngineConfig(
            prefill_pages=pages[0],
            decode_pages=pages[1],
            page_size=self.page_size,
            max_batch_tokens=self.max_batch_tokens,
            prefill_order=self.prefill_order,
            context_length=context,
            scrub=self.scrub,
            prefix_cache=self.prefix_cache,
            shared_prefix_namespace=SHARED_NAMESPACE if self.shared_prefix_cache else None,
            eos_token_ids=eos,
            chunk_size=self.chunk_size,
        )

    def serve_config(self, loaded: LoadedModel, context: int, engine: EngineConfig) -> ServeConfig:
        """The HTTP edge's config; the engine facts read from the engine's own config."""
        return ServeConfig(
            model_name=loaded.name,
            context_length=context,
            vocab_size=loaded.config.vocab_size,
            headroom=self.headroom,
            allow_undersized_pool=self.allow_undersized_pool,
            faults=self.faults,
            lab_profile=self.lab_profile,
            default_max_tokens=self.default_max_tokens,
            scrub=engine.scrub,
            transport=InProcessTransport.name,
            disaggregated=False,
            prefix_cache=engine.prefix_cache,
            shared_prefix_cache=engine.shared_prefix_namespace is not None,
        )


@dataclass(frozen=True, slots=True)
class ServerParts:
    loaded: LoadedModel
    pipeline: LocalPipeline
    config: ServeConfig
    geometry: KVGeometry
    sizing: tuple[str, ...]  # how each role's pool was sized, for the start-up log


def build_local(spec: LocalSpec, *, torch_threads: int = 0) -> ServerParts:
    """Load the checkpoint and build a (not yet started) pipeline and the server's config.

    `torch_threads` are the engine thread's (engine/threads.py; 0: torch's setting).
    """
    loaded = load_model(spec.model_dir, kind=spec.kind)
    geometry = loaded.config.kv_geometry(page_size=spec.page_size)
    model_ctx = loaded.config.max_position_embeddings
    ctx = spec.context_length if spec.context_length is not None else model_ctx
    available = available_memory_bytes()  # measured once, after the weights are in memory
    prefill, decode = (spec.pools.plan(r, geometry, ctx, spec.headroom, available) for r in ROLES)
    engine = spec.engine_config((prefill.pages, decode.pages), ctx, loaded.tokenizer.eos_ids)
    pipeline = LocalPipeline(
        loaded.model,
        geometry,
        engine,
        spec.faults,
        kv_link=inprocess_link,
        torch_threads=torch_threads,
    )
    config = spec.serve_config(loaded, ctx, engine)
    return ServerParts(loaded, pipeline, config, geometry, (prefill.how, decode.how))
