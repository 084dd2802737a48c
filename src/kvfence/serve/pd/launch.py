"""Start the disaggregated roles: one role per process (multi-host), or all of them on loopback.

`kvfence serve --disaggregated` = router + N prefill + M decode workers as
child processes on loopback, supervised together (one dies -> all stop, with
a message naming it). `kvfence serve --role router|prefill|decode` runs one
role for a multi-host deployment; the addresses say where the others are.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
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


def run_router(spec: RouterSpec, tenants: TenantRegistry, announce: object) -> int:
    """Serve the public API over worker processes. Exit 1 if the live pools fail the gate (I4)."""
    model_dir = Path(spec.model_dir)
    config = ModelConfig.from_file(model_dir / "config.json")
    tokenizer = Tokenizer.from_dir(model_dir)
    faults = FaultSet.parse(spec.faults)
    serve_config = ServeConfig(
        model_name=model_dir.name,
        context_length=spec.context_length or config.max_position_embeddings,
        vocab_size=config.vocab_size,
        headroom=spec.headroom,
        allow_undersized_pool=spec.allow_undersized_pool,
        faults=faults,
        default_max_tokens=spec.default_max_tokens,
        scrub_policy=spec.scrub_policy,
        transport=spec.transport,
        disaggregated=True,
        prefix_cache=spec.prefix_cache,
        shared_prefix_cache=spec.shared_prefix_cache,
    )
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


def disaggregated_children(
    role_args: Sequence[str],
    *,
    n_prefill: int,
    n_decode: int,
    host: str,
    port: int,
    tenants_file: Path | None,
    router_args: Sequence[str] = (),
) -> list[ChildSpec]:
    """The argv of every role on loopback: workers first, the router last.

    `tenants_file` None is the dev mode: the router gets `--no-auth` and checks the
    loopback rule itself (a keyless registry has no file form, so none is written).
    """
    if n_prefill < 1 or n_decode < 1:
        raise ValueError("--prefill and --decode need at least one worker each")
    loop = "tcp://127.0.0.1"
    router_inbox = f"{loop}:{free_port()}"
    prefill = [f"{loop}:{free_port()}" for _ in range(n_prefill)]
    decode = [f"{loop}:{free_port()}" for _ in range(n_decode)]
    base = (sys.executable, "-m", "kvfence", "serve", *role_args)
    children = [
        ChildSpec(
            f"prefill-{i}",
            (*base, "--role", "prefill", "--inbox", a, "--router-addr", router_inbox),
        )
        for i, a in enumerate(prefill)
    ]
    children += [
        ChildSpec(
            f"decode-{i}", (*base, "--role", "decode", "--inbox", a, "--router-addr", router_inbox)
        )
        for i, a in enumerate(decode)
    ]
    peers = [x for a in prefill for x in ("--prefill-addr", a)] + [
        x for a in decode for x in ("--decode-addr", a)
    ]
    auth = ("--no-auth",) if tenants_file is None else ("--tenants", str(tenants_file))
    children.append(
        ChildSpec(
            "router",
            (
                *base,
                "--role",
                "router",
                "--inbox",
                router_inbox,
                *peers,
                "--host",
                host,
                "--port",
                str(port),
                *auth,
                *router_args,
            ),
        )
    )
    return children


def run_disaggregated(
    role_args: Sequence[str],
    *,
    n_prefill: int,
    n_decode: int,
    host: str,
    port: int,
    tenants: TenantRegistry,
    router_args: Sequence[str] = (),
) -> int:
    """Supervise every role; Ctrl-C or any role's exit stops them all."""
    with tempfile.TemporaryDirectory(prefix="kvfence-pd-") as tmp:
        tenants_file: Path | None = None
        if tenants.auth != "none":
            tenants_file = Path(tmp) / "tenants.json"
            tenants_file.touch(mode=0o600)
            tenants_file.write_text(tenants.to_json())
        children = disaggregated_children(
            role_args,
            n_prefill=n_prefill,
            n_decode=n_decode,
            host=host,
            port=port,
            tenants_file=tenants_file,
            router_args=router_args,
        )
        return Supervisor(children).run_until_done()
