"""Start the disaggregated roles: one role per process (multi-host), or all of them on loopback.

`kvfence serve --disaggregated` = router + N prefill + M decode workers as
child processes on loopback, supervised together (one dies -> all stop, with
a message naming it). `kvfence serve --role router|prefill|decode` runs one
role for a multi-host deployment; the addresses say where the others are
(the router role is `router_role.py`, the workers `workers.py`).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvfence.serve.supervisor import ChildSpec, Supervisor, free_port
from kvfence.serve.tenants import TenantRegistry


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
