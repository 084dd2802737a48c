"""Start the disaggregated roles: one role per process (multi-host), or all of them on loopback.

`kvfence serve --disaggregated` = router + N prefill + M decode workers as
child processes on loopback, supervised together (one dies -> all stop, with
a message naming it). `kvfence serve --role router|prefill|decode` runs one
role for a multi-host deployment; the addresses say where the others are.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Sequence
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
from kvfence.serve.pd.spec import WorkerSpec, write_worker_spec
from kvfence.serve.supervisor import ChildSpec, Supervisor, free_port
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


@dataclass(frozen=True, slots=True)
class Loopback:
    """The control addresses of every role on one host."""

    router: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    @classmethod
    def pick(cls, n_prefill: int, n_decode: int) -> Loopback:
        if n_prefill < 1 or n_decode < 1:
            raise ValueError("--prefill and --decode need at least one worker each")
        loop = "tcp://127.0.0.1"
        return cls(
            f"{loop}:{free_port()}",
            tuple(f"{loop}:{free_port()}" for _ in range(n_prefill)),
            tuple(f"{loop}:{free_port()}" for _ in range(n_decode)),
        )

    def peer_args(self) -> list[str]:
        return [x for a in self.prefill for x in ("--prefill-addr", a)] + [
            x for a in self.decode for x in ("--decode-addr", a)
        ]


# Builds a worker's spec from its role, its inbox and the router's inbox.
WorkerSpecFor = Callable[[str, str, str], WorkerSpec]


def worker_children(spec_for: WorkerSpecFor, addrs: Loopback, spec_dir: Path) -> list[ChildSpec]:
    """One child per worker, each handed the spec built here, as a file (serve/pd/spec.py)."""
    children = []
    for role, inboxes in (("prefill", addrs.prefill), ("decode", addrs.decode)):
        for i, inbox in enumerate(inboxes):
            path = spec_dir / f"{role}-{i}.json"
            write_worker_spec(spec_for(role, inbox, addrs.router), path)
            argv = (sys.executable, "-m", "kvfence.serve.pd.worker_entry", str(path))
            children.append(ChildSpec(f"{role}-{i}", argv))
    return children


def router_child(
    router_args: Sequence[str], addrs: Loopback, host: str, port: int, tenants_file: Path
) -> ChildSpec:
    where = ["--inbox", addrs.router, *addrs.peer_args(), "--host", host, "--port", str(port)]
    argv = (sys.executable, "-m", "kvfence", "serve", "--role", "router", *where)
    return ChildSpec("router", (*argv, "--tenants", str(tenants_file), *router_args))


def run_disaggregated(
    spec_for: WorkerSpecFor,
    *,
    n_prefill: int,
    n_decode: int,
    host: str,
    port: int,
    tenants: TenantRegistry,
    router_args: Sequence[str] = (),
) -> int:
    """Supervise every role (workers first, the router last); Ctrl-C or any role's exit stops
    them all."""
    addrs = Loopback.pick(n_prefill, n_decode)
    with tempfile.TemporaryDirectory(prefix="kvfence-pd-") as tmp:
        tenants_file = Path(tmp) / "tenants.json"
        tenants_file.touch(mode=0o600)
        tenants_file.write_text(tenants.to_json())
        children = worker_children(spec_for, addrs, Path(tmp))
        children.append(router_child(router_args, addrs, host, port, tenants_file))
        return Supervisor(children).run_until_done()
