"""Start the disaggregated roles: one role per process (multi-host), or all of them on loopback.

`kvfence serve --disaggregated` = router + N prefill + M decode workers as
child processes on loopback, supervised together (one dies -> all stop, with
a message naming it). `kvfence serve --role router|prefill|decode` runs one
role for a multi-host deployment; the addresses say where the others are
(the router role is `router_role.py`, the workers `workers.py`, started from the
`WorkerSpec` built here by `worker_entry.py`).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfence.serve.pd.spec import WorkerSpec, write_worker_spec
from kvfence.serve.supervisor import ChildSpec, Supervisor, free_port
from kvfence.serve.tenants import TenantRegistry


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
    router_args: Sequence[str], addrs: Loopback, host: str, port: int, tenants_file: Path | None
) -> ChildSpec:
    """The router's argv. `tenants_file` None is the dev mode: the router gets `--no-auth` and
    checks the loopback rule itself (a keyless registry has no file form, so none is written)."""
    where = ["--inbox", addrs.router, *addrs.peer_args(), "--host", host, "--port", str(port)]
    argv = (sys.executable, "-m", "kvfence", "serve", "--role", "router", *where)
    auth = ("--no-auth",) if tenants_file is None else ("--tenants", str(tenants_file))
    return ChildSpec("router", (*argv, *auth, *router_args))


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
        tenants_file: Path | None = None
        if tenants.auth != "none":
            tenants_file = Path(tmp) / "tenants.json"
            tenants_file.touch(mode=0o600)
            tenants_file.write_text(tenants.to_json())
        children = worker_children(spec_for, addrs, Path(tmp))
        children.append(router_child(router_args, addrs, host, port, tenants_file))
        return Supervisor(children).run_until_done()
