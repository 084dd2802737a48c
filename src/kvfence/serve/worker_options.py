"""One worker's spec from `kvfence serve`'s options: shared by the hub's workers and the
SGLang-style workers, so neither entry point imports the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfence.faults import FaultSet
from kvfence.serve.pd.spec import WorkerSpec
from kvfence.serve.per_role import parse_per_role


def _per_role(value: str | None, role: str) -> int | None:
    prefill, decode = parse_per_role(value, f"--kv-* ({role})")
    return prefill if role == "prefill" else decode


def worker_spec(
    params: dict[str, Any],
    faults: FaultSet,
    model_dir: Path,
    role: str,
    inbox: str,
    router: str,
    torch_threads: int | None = None,
) -> WorkerSpec:
    """One worker's spec from the `serve` options; `torch_threads` overrides the option."""
    return WorkerSpec(
        role=role,
        model_dir=str(model_dir),
        model_kind=params["model_kind"],
        inbox=inbox,
        router=router,
        pages=_per_role(params["kv_pages"], role),
        kv_bytes=_per_role(params["kv_bytes"], role),
        kv_memory_fraction=params["kv_memory_fraction"],
        page_size=params["page_size"],
        max_batch_tokens=params["max_batch_tokens"],
        prefill_order=params["prefill_order"],
        context_length=params["context_length"],
        scrub=params["scrub"],
        prefix_cache=not params["no_prefix_cache"],
        shared_prefix_namespace="shared" if params["shared_prefix_cache"] else None,
        faults=tuple(faults.names()),
        transport=params["transport"],
        kv_host=params["kv_host"],
        torch_threads=params["torch_threads"] if torch_threads is None else torch_threads,
    )
