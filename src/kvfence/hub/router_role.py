"""The router role of a disaggregated deployment: the public API over worker processes.

Kept apart from `launch.py` (the supervisor) so that the supervisor and the
worker roles never import the web stack: each of them starts faster, and the
supervisor spawns the workers sooner.
"""

from __future__ import annotations

from pathlib import Path

from kvfence.hub.backend import PDBackend
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.announce import announce
from kvfence.serve.config import Capacity
from kvfence.serve.serving import Listen, Server, run_server
from kvfence.serve.specs import RouterSpec
from kvfence.serve.tenants import TenantRegistry


def run_router(spec: RouterSpec, tenants: TenantRegistry) -> int:
    """Serve the public API over worker processes. Exit 1 if the live pools fail the gate (I4)."""
    config = spec.serve_config()
    tokenizer = Tokenizer.from_dir(Path(spec.model_dir))
    backend = PDBackend(
        spec.inbox, list(spec.prefill_addr), list(spec.decode_addr), faults=config.faults
    )
    log = None if spec.request_log is None else Path(spec.request_log)

    def listening(url: str, capacity: Capacity) -> None:
        announce(url, tenants, config.model_name, capacity.report.message())

    return run_server(
        Server(backend, tokenizer, config, tenants, log),
        Listen(spec.host, spec.port, spec.log_level),
        listening,
        ready=backend.wait_for_workers,  # the gate needs every worker's live pool
    )
