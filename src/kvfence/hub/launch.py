"""Start the disaggregated roles: one role per process (multi-host), or all of them on loopback.

`kvfence serve --disaggregated` = router + N prefill + M decode workers as
child processes on loopback, supervised together (one dies -> all stop, with
a message naming it). `kvfence serve --role router|prefill|decode` runs one
role for a multi-host deployment; the addresses say where the others are
(the router role is `router_role.py`, the workers `workers.py`). Here each child's spec
(`WorkerSpec`, `RouterSpec`) is built once and written as a file its entry validates
(`worker_group.py`, which forks every worker from one interpreter, and `router_entry.py`);
no role's options go back through argv.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfence.serve.specs import RouterSpec, WorkerSpec, write_spec
from kvfence.serve.supervisor import ChildSpec, Supervisor
from kvfence.serve.tenants import TenantRegistry

# libzmq copies an ipc:// path into a sockaddr_un: 108 bytes with the terminating NUL.
IPC_PATH_MAX = 107


@dataclass(frozen=True, slots=True)
class Loopback:
    """The control addresses of every role on one host."""

    router: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]

    @classmethod
    def pick(cls, n_prefill: int, n_decode: int, sock_dir: Path) -> Loopback:
        """Unix-socket inboxes in `sock_dir`, the supervisor's private (0700) directory.

        Not TCP ports on 127.0.0.1: a port picked free here was only free until a worker
        bound it, and another process's bind or outgoing connection could take it first
        (CI saw "Address already in use"). A path in a directory this process made is
        nobody else's, and no other local user can reach an inbox through it either."""
        if n_prefill < 1 or n_decode < 1:
            raise ValueError("--prefill and --decode need at least one worker each")
        names = ["router", *(f"prefill-{i}" for i in range(n_prefill))]
        names += [f"decode-{i}" for i in range(n_decode)]
        paths = [str(sock_dir / f"{name}.sock") for name in names]
        if len(longest := max(paths, key=len).encode()) > IPC_PATH_MAX:
            raise ValueError(
                f"the control socket path {longest.decode()!r} is {len(longest)} bytes, over "
                f"the {IPC_PATH_MAX} a Unix socket takes: set TMPDIR to a shorter directory"
            )
        addrs = [f"ipc://{path}" for path in paths]
        return cls(addrs[0], tuple(addrs[1 : 1 + n_prefill]), tuple(addrs[1 + n_prefill :]))


# Builds a worker's spec from its role, its inbox and the router's inbox.
WorkerSpecFor = Callable[[str, str, str], WorkerSpec]
# Builds the router's spec from the control addresses picked on loopback.
RouterSpecFor = Callable[[Loopback], RouterSpec]


def worker_children(spec_for: WorkerSpecFor, addrs: Loopback, spec_dir: Path) -> list[ChildSpec]:
    """The workers as one child, the worker group, handed each worker's spec built here as a
    file (serve/specs.py); it imports torch once and forks them (worker_group.py)."""
    paths = []
    for role, inboxes in (("prefill", addrs.prefill), ("decode", addrs.decode)):
        for i, inbox in enumerate(inboxes):
            path = spec_dir / f"{role}-{i}.json"
            write_spec(spec_for(role, inbox, addrs.router), path)
            paths.append(str(path))
    argv = (sys.executable, "-m", "kvfence.hub.worker_group", *paths)
    return [ChildSpec("workers", argv)]


def router_child(spec: RouterSpec, tenants: TenantRegistry, spec_dir: Path) -> ChildSpec:
    """The router child, handed its spec as a file like the workers. A keyless dev registry
    has no file form: the spec then says `no_auth` and the router checks the loopback rule
    itself; any other registry is written beside the spec, readable by the owner only."""
    if tenants.auth == "none":
        spec = dataclasses.replace(spec, tenants_file=None, no_auth=True)
    else:
        tenants_file = spec_dir / "tenants.json"
        tenants_file.touch(mode=0o600)
        tenants_file.write_text(tenants.to_json())
        spec = dataclasses.replace(spec, tenants_file=str(tenants_file), no_auth=False)
    path = spec_dir / "router.json"
    write_spec(spec, path)
    return ChildSpec("router", (sys.executable, "-m", "kvfence.hub.router_entry", str(path)))


def run_disaggregated(
    spec_for: WorkerSpecFor,
    router_for: RouterSpecFor,
    *,
    n_prefill: int,
    n_decode: int,
    tenants: TenantRegistry,
) -> int:
    """Supervise every role (workers first, the router last); Ctrl-C or any role's exit stops
    them all. Every spec is built and validated before the first child starts."""
    with tempfile.TemporaryDirectory(prefix="kvfence-pd-") as tmp:
        addrs = Loopback.pick(n_prefill, n_decode, Path(tmp))
        router = router_child(router_for(addrs), tenants, Path(tmp))
        children = [*worker_children(spec_for, addrs, Path(tmp)), router]
        return Supervisor(children).run_until_done()
