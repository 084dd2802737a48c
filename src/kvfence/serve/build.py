"""Wiring for the single-process server: checkpoint -> model -> LocalPipeline -> ServeConfig.

Pool sizes are given in pages or bytes per role; bytes are turned into whole
pages the way engines do; given neither, from the memory available
(`serve.pool_sizing`). The server's engine facts
(scrub policy, prefix-cache namespacing, transport) are read from the
pipeline's own configuration, so /server_info reports what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
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
class ServerParts:
    loaded: LoadedModel
    pipeline: LocalPipeline
    config: ServeConfig
    geometry: KVGeometry
    sizing: tuple[str, ...]  # how each role's pool was sized, for the start-up log


def build_local(
    model_dir: str | Path,
    *,
    kind: str = "llama",
    context_length: int | None = None,
    pools: PoolSizes | None = None,
    page_size: int = default_of(EngineConfig, "page_size"),
    max_batch_tokens: int = default_of(EngineConfig, "max_batch_tokens"),
    prefill_order: PrefillOrder = PrefillOrder.SHORTEST,
    scrub: ScrubPolicy = ScrubPolicy.NONE,
    faults: FaultSet | None = None,
    prefix_cache: bool = True,
    shared_prefix_cache: bool = False,
    headroom: float = DEFAULT_HEADROOM,
    allow_undersized_pool: bool = False,
    lab_profile: str | None = None,
    default_max_tokens: int = default_of(ServeConfig, "default_max_tokens"),
    chunk_size: int | None = None,
    torch_threads: int = 0,
) -> ServerParts:
    """Load the checkpoint and build a (not yet started) pipeline and the server's config."""
    loaded = load_model(model_dir, kind=kind)
    geometry = loaded.config.kv_geometry(page_size=page_size)
    ctx = context_length if context_length is not None else loaded.config.max_position_embeddings
    pools = pools or PoolSizes()
    available = available_memory_bytes()  # measured once, after the weights are in memory
    prefill, decode = (pools.plan(r, geometry, ctx, headroom, available) for r in ROLES)
    engine = EngineConfig(
        prefill_pages=prefill.pages,
        decode_pages=decode.pages,
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        prefill_order=prefill_order,
        context_length=ctx,
        scrub=scrub,
        prefix_cache=prefix_cache,
        shared_prefix_namespace=SHARED_NAMESPACE if shared_prefix_cache else None,
        eos_token_ids=loaded.tokenizer.eos_ids,
        chunk_size=chunk_size,
    )
    faults = faults or FaultSet()
    pipeline = LocalPipeline(
        loaded.model, geometry, engine, faults, kv_link=inprocess_link, torch_threads=torch_threads
    )
    config = ServeConfig(
        model_name=loaded.name,
        context_length=ctx,
        vocab_size=loaded.config.vocab_size,
        headroom=headroom,
        allow_undersized_pool=allow_undersized_pool,
        faults=faults,
        lab_profile=lab_profile,
        default_max_tokens=default_max_tokens,
        scrub=engine.scrub,
        transport=InProcessTransport.name,
        disaggregated=False,
        prefix_cache=engine.prefix_cache,
        shared_prefix_cache=engine.shared_prefix_namespace is not None,
    )
    return ServerParts(loaded, pipeline, config, geometry, (prefill.how, decode.how))
