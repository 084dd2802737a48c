"""The router role of a disaggregated deployment: the public API over worker processes.

Kept apart from `launch.py` (the supervisor) so that the supervisor and the
worker roles never import the web stack: each of them starts faster, and the
supervisor spawns the workers sooner.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from kvfence.engine.sizing import CapacityGateError
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.config import EXIT_GATE, decide_capacity
from kvfence.serve.pd.backend import PDBackend
from kvfence.serve.specs import RouterSpec
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import bind, serve_forever, url_of

# Prints the router's URL, keys and gate verdict once it listens (serve/cli.py `announce`).
Announce = Callable[[str, TenantRegistry, str, str], None]


def run_router(spec: RouterSpec, tenants: TenantRegistry, announce: Announce) -> int:
    """Serve the public API over worker processes. Exit 1 if the live pools fail the gate (I4)."""
    serve_config = spec.serve_config()
    tokenizer = Tokenizer.from_dir(Path(spec.model_dir))
    backend = PDBackend(
        spec.inbox, list(spec.prefill), list(spec.decode), faults=serve_config.faults
    )
    backend.start()
    try:
        backend.wait_for_workers()
        try:
            capacity = decide_capacity(serve_config, backend.stats().pools)
        except CapacityGateError as e:
            print(str(e), file=sys.stderr)  # I4: the router does not take traffic
            return EXIT_GATE
        app = create_app(
            backend,
            tokenizer,
            serve_config,
            tenants,
            capacity=capacity,
            request_log=None if spec.request_log is None else Path(spec.request_log),
        )
        sock = bind(spec.host, spec.port)
        announce(url_of(sock), tenants, serve_config.model_name, capacity.report.message())
        serve_forever(app, sock, log_level=spec.log_level)
        sock.close()
        return 0
    finally:
        backend.stop()
