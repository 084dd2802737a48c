"""The lab on the real PD stack: the incident's server behind sglang-router, KV over Mooncake.

`routed_server` is a `ServerFactory` (scenario.py) for the topology the
incident ran on: the real `sglang-router --pd-disaggregation` in front of one
kvfence prefill and one kvfence decode worker (`sglang_stack/stack.py`), the
KV moved by a real transfer engine (Mooncake over TCP by default), with the
same scaled pools and fault switches as the single-process lab server. The
router accepts text prompts only, so the scenario sends text there.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx

from kvfence.faults import Fault, FaultSet
from kvfence.lab.profiles import Scale
from kvfence.lab.scenario import (
    DEFAULT_SCALE,
    OPERATOR,
    TENANT_A,
    TENANT_B,
    LabServer,
    ServerFactory,
    lab_server,
)
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.stack import Stack, StackSpec

TOPOLOGIES = ("single", "sglang-router")


def worker_args(
    checkpoint: Path, faults: FaultSet, model_kind: str, scale: Scale, transport: str
) -> tuple[str, ...]:
    """`kvfence serve` options for both workers: the lab server's geometry and switches."""
    args = [
        "--model", str(checkpoint), "--model-kind", model_kind,
        "--context-length", str(scale.context_length), "--page-size", str(scale.page_size),
        "--kv-pages", f"prefill={scale.prefill_pages},decode={scale.decode_pages}",
        "--torch-threads", "1", "--transport", transport, "--no-prefix-cache",
    ]  # fmt: skip
    if Fault.UNDERSIZED_POOL not in faults:
        args.append("--allow-undersized-pool")  # the honest mode: the edge rejects over-pool (I4)
    for f in faults.names():
        args += ["--lab-fault", f]
    return tuple(args)


@contextmanager
def routed_server(
    checkpoint: Path,
    faults: FaultSet,
    *,
    model_kind: str = "mirror",
    scale: Scale = DEFAULT_SCALE,
    profile: str | None = None,
    transport: str = "mooncake",
) -> Iterator[LabServer]:
    """sglang-router + a prefill and a decode worker with these switches; the router's URL."""
    del profile  # the workers report their switches in /server_info; no profile name there
    tenants = TenantRegistry.generate((TENANT_A, TENANT_B))
    keys = {t.name: t.keys[0] for t in tenants.tenants}
    keys[OPERATOR] = tenants.operator_keys[0]
    with tempfile.TemporaryDirectory(prefix="kvfence-lab-sgl-") as tmp:
        tenants_file = Path(tmp) / "tenants.json"
        tenants_file.touch(mode=0o600)
        tenants_file.write_text(tenants.to_json())
        # The lab's audit reads the router's /workers with a tenant key: keyless control plane
        # on the router's loopback listener (StackSpec.keyed_control_plane).
        spec = StackSpec(
            worker_args(checkpoint, faults, model_kind, scale, transport),
            tenants_file,
            keyed_control_plane=False,
        )
        with Stack(spec, workdir=Path(tmp)) as stack:
            decode = next(w for w in stack.workers if w.role == "decode")

            def info() -> dict[str, Any]:
                # decode's live facts, read on the router's path (operator data, no tenant key)
                r = httpx.get(f"{stack.router_url_of(decode)}/server_info", timeout=30)
                return dict(r.json())

            tokenizer = Tokenizer.from_dir(checkpoint)
            # The lab measures the router and its workers as they stand, so it talks to the
            # router's own listener (loopback, the operator's address), not the tenants' edge.
            url = stack.admin_url
            yield LabServer(url, checkpoint.name, keys, tokenizer, info, text_prompts=True)


def server_for(topology: str, transport: str = "mooncake") -> ServerFactory:
    """The server factory for a `--topology`."""
    if topology == "single":
        return lab_server
    if topology == "sglang-router":

        def factory(
            checkpoint: Path, faults: FaultSet, **kw: Any
        ) -> AbstractContextManager[LabServer]:
            return routed_server(checkpoint, faults, transport=transport, **kw)

        return factory
    raise ValueError(f"unknown lab topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
