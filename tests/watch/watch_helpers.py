"""A real hardened kvfence server on loopback (in-process, the tiny real transformer)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvfence.lab.scenario import OPERATOR, TENANT_A, TENANT_B
from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, build_local
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread


@contextmanager
def hardened(checkpoint: Path, context: int = 512) -> Iterator[tuple[str, dict[str, str]]]:
    """Every defence on, pools well above the context, real tiny transformer."""
    parts = build_local(
        LocalSpec(
            checkpoint,
            kind="llama",
            context_length=context,
            pools=PoolSizes(prefill_pages=128, decode_pages=128),
            prefix_cache=False,
        )
    )
    tenants = TenantRegistry.generate((TENANT_A, TENANT_B))
    keys = {t.name: t.keys[0] for t in tenants.tenants} | {OPERATOR: tenants.operator_keys[0]}
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    parts.pipeline.start()
    try:
        with ServerThread(app) as srv:
            yield srv.url, keys
    finally:
        parts.pipeline.stop()
