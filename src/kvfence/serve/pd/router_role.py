"""The router role of a disaggregated deployment: the public API over worker processes.

Kept apart from `launch.py` (the supervisor) so that the supervisor and the
worker roles never import the web stack: each of them starts faster, and the
supervisor spawns the workers sooner.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvfence.engine.config import default_of
from kvfence.engine.sizing import CapacityGateError
from kvfence.faults import FaultSet
from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.config import ServeConfig, decide_capacity
from kvfence.serve.pd.backend import PDBackend, Timeouts
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import bind, serve_forever, url_of

EXIT_GATE = 1


@dataclass(frozen=True, slots=True)
class RouterSpec:
    model_dir: str
    inbox: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str
    port: int
    transport: str
    context_length: int | None = None
    headroom: float = default_of(ServeConfig, "headroom")
    allow_undersized_pool: bool = False
    faults: tuple[str, ...] = ()
    default_max_tokens: int = default_of(ServeConfig, "default_max_tokens")
    scrub_policy: str = default_of(ServeConfig, "scrub_policy")
    prefix_cache: bool = True
    shared_prefix_cache: bool = False
    timeouts: Timeouts = field(default_factory=Timeouts)
    log_level: str = "warning"
    request_log: Path | None = None

    def serve_config(self) -> ServeConfig:
        """The router's config, with the model's facts read from its config.json."""
        config = ModelConfig.from_file(Path(self.model_dir) / "config.json")
        return ServeConfig(
            model_name=Path(self.model_dir).name,
            context_length=self.context_length or config.max_position_embeddings,
            vocab_size=config.vocab_size,
            headroom=self.headroom,
            allow_undersized_pool=self.allow_undersized_pool,
            faults=FaultSet.parse(self.faults),
            default_max_tokens=self.default_max_tokens,
            scrub_policy=self.scrub_policy,
            transport=self.transport,
            disaggregated=True,
            prefix_cache=self.prefix_cache,
            shared_prefix_cache=self.shared_prefix_cache,
        )


def run_router(spec: RouterSpec, tenants: TenantRegistry, announce: object) -> int:
    """Serve the public API over worker processes. Exit 1 if the live pools fail the gate (I4)."""
    serve_config = spec.serve_config()
    tokenizer = Tokenizer.from_dir(Path(spec.model_dir))
    faults = serve_config.faults
    backend = PDBackend(
        spec.inbox, list(spec.prefill), list(spec.decode), faults=faults, timeouts=spec.timeouts
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
            request_log=spec.request_log,
        )
        sock = bind(spec.host, spec.port)
        if callable(announce):
            announce(url_of(sock), tenants, serve_config.model_name, capacity.report.message())
        serve_forever(app, sock, log_level=spec.log_level)
        sock.close()
        return 0
    finally:
        backend.stop()
