"""A real disaggregated cluster: worker processes (`kvfence serve --role …`) and an in-process router."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from kvfence.faults import FaultSet
from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.config import ServeConfig
from kvfence.serve.pd.backend import PDBackend, Timeouts
from kvfence.serve.supervisor import free_port
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

TENANTS = ("a", "b", "c", "d")


@dataclass
class Cluster:
    url: str
    backend: PDBackend
    tenants: TenantRegistry
    model: str
    workers: dict[str, subprocess.Popen[bytes]]  # "prefill-0" / "decode-1" -> process
    inboxes: dict[str, str]

    def key(self, tenant: str = "a") -> str:
        if tenant == "operator":
            return self.tenants.operator_keys[0]
        return next(t.keys[0] for t in self.tenants.tenants if t.name == tenant)

    def client(self, tenant: str = "a", timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.key(tenant), max_retries=0, timeout=timeout
        )

    def post(self, path: str, tenant: str = "a", **kw: object) -> httpx.Response:
        return httpx.post(
            self.url + path,
            headers={"Authorization": f"Bearer {self.key(tenant)}"},
            timeout=120,
            **kw,
        )  # type: ignore[arg-type]

    def info(self) -> dict[str, object]:
        r = httpx.get(
            self.url + "/server_info",
            headers={"Authorization": f"Bearer {self.key('operator')}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    def wait_quiet(self, deadline_s: float = 60.0) -> dict[str, str]:
        """Until no request is open and every live worker reports its ledger check; returns the reports."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            reports = self.backend.integrity()
            dead = set(self.backend.dead_workers())
            live = {a: r for a, r in reports.items() if a not in dead}
            if self.backend.open_rooms() == 0 and live and all(r for r in live.values()):
                return live
            time.sleep(0.1)
        raise AssertionError(f"cluster not quiet after {deadline_s} s: {self.backend.integrity()}")

    def signal(self, worker: str, sig: int) -> None:
        os.kill(self.workers[worker].pid, sig)


@contextmanager
def cluster(
    checkpoint: Path,
    *,
    kind: str = "mirror",
    transport: str = "tcp",
    n_prefill: int = 1,
    n_decode: int = 1,
    extra: Sequence[str] = (),
    faults: Sequence[str] = (),
    timeouts: Timeouts | None = None,
    kv_pages: str = "prefill=512,decode=512",
) -> Iterator[Cluster]:
    loop = "tcp://127.0.0.1"
    router_inbox = f"{loop}:{free_port()}"
    inboxes = {f"prefill-{i}": f"{loop}:{free_port()}" for i in range(n_prefill)}
    inboxes |= {f"decode-{i}": f"{loop}:{free_port()}" for i in range(n_decode)}
    fault_args = [x for f in faults for x in ("--lab-fault", f)]
    workers: dict[str, subprocess.Popen[bytes]] = {}
    for name, inbox in inboxes.items():
        argv = [sys.executable, "-m", "kvfence", "serve", "--role", name.split("-")[0], "--inbox", inbox,
                "--router-addr", router_inbox, "--model", str(checkpoint), "--model-kind", kind,
                "--transport", transport, "--kv-pages", kv_pages, "--torch-threads", "1", *fault_args, *extra]  # fmt: skip
        workers[name] = subprocess.Popen(argv)
    backend = PDBackend(
        router_inbox,
        [a for n, a in inboxes.items() if n.startswith("prefill")],
        [a for n, a in inboxes.items() if n.startswith("decode")],
        faults=FaultSet.parse(faults),
        timeouts=timeouts or Timeouts(liveness_s=3.0),
    )
    backend.start()
    try:
        backend.wait_for_workers(240)
        config = ModelConfig.from_file(checkpoint / "config.json")
        serve_config = ServeConfig(
            model_name=checkpoint.name,
            context_length=config.max_position_embeddings,
            vocab_size=config.vocab_size,
            faults=FaultSet.parse(faults),
            transport=transport,
            disaggregated=True,
        )
        tenants = TenantRegistry.generate(TENANTS)
        app = create_app(backend, Tokenizer.from_dir(checkpoint), serve_config, tenants)
        with ServerThread(app) as srv:
            yield Cluster(srv.url, backend, tenants, checkpoint.name, workers, inboxes)
    finally:
        for p in workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in workers.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        backend.stop()
