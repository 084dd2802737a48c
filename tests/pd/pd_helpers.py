"""A real disaggregated cluster: worker processes (`kvfence serve --role …`) and an in-process router."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import openai

from kvfence.faults import FaultSet
from kvfence.hub.backend import PDBackend, Timeouts
from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.config import ServeConfig
from kvfence.serve.supervisor import free_port, spawn
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


# A worker's inbox port is picked here and may be taken by another process before the
# worker binds it (the router must know every worker's address up front, so a worker cannot
# bind port 0 and tell us). Such a start is retried with fresh ports, a bounded number of times.
START_TRIES = 3
ADDR_IN_USE = "Address already in use"


class PortTaken(Exception):
    """A worker exited at start-up because its inbox port was already in use."""


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
    fault_args = [x for f in faults for x in ("--lab-fault", f)]
    worker_args = ["--model", str(checkpoint), "--model-kind", kind, "--transport", transport,
                   "--kv-pages", kv_pages, "--torch-threads", "1", *fault_args, *extra]  # fmt: skip
    for attempt in range(1, START_TRIES + 1):
        try:
            with _cluster_once(
                checkpoint, transport, n_prefill, n_decode, worker_args, faults, timeouts
            ) as c:
                yield c
            return
        except PortTaken as e:
            if attempt == START_TRIES:
                raise AssertionError(f"{START_TRIES} starts lost a port race: {e}") from e


@contextmanager
def _cluster_once(
    checkpoint: Path,
    transport: str,
    n_prefill: int,
    n_decode: int,
    worker_args: Sequence[str],
    faults: Sequence[str],
    timeouts: Timeouts | None,
) -> Iterator[Cluster]:
    loop = "tcp://127.0.0.1"
    inboxes = {f"prefill-{i}": f"{loop}:{free_port()}" for i in range(n_prefill)}
    inboxes |= {f"decode-{i}": f"{loop}:{free_port()}" for i in range(n_decode)}
    backend = PDBackend(
        f"{loop}:0",  # the in-process router binds a port the OS picks: no race for this one
        [a for n, a in inboxes.items() if n.startswith("prefill")],
        [a for n, a in inboxes.items() if n.startswith("decode")],
        faults=FaultSet.parse(faults),
        timeouts=timeouts or Timeouts(liveness_s=3.0),
    )
    workers: dict[str, subprocess.Popen[bytes]] = {}
    with ExitStack() as files:
        logs = {name: files.enter_context(tempfile.TemporaryFile()) for name in inboxes}
        backend.start()
        try:
            for name, inbox in inboxes.items():
                argv = [sys.executable, "-m", "kvfence", "serve", "--role", name.split("-")[0],
                        "--inbox", inbox, "--router-addr", backend.inbox.addr, *worker_args]  # fmt: skip
                # spawn: a worker gets SIGTERM when pytest dies, even by SIGKILL (no orphans).
                workers[name] = spawn(argv, stdout=logs[name], stderr=subprocess.STDOUT)
            _wait_for_workers(backend, workers, logs, deadline_s=240)
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
            for name, log in logs.items():  # into pytest's captured stderr: shown when a test fails
                sys.stderr.write(f"--- {name} log ---\n{_read(log)}")


def _wait_for_workers(
    backend: PDBackend,
    workers: dict[str, subprocess.Popen[bytes]],
    logs: dict[str, IO[bytes]],
    deadline_s: float,
) -> None:
    """Until every worker reported; a worker that exits first ends the wait (PortTaken if it
    lost its inbox port, else an AssertionError with its log)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            backend.wait_for_workers(0.5)
            return
        except TimeoutError:
            if time.monotonic() > end:
                raise
        for name, p in workers.items():
            if p.poll() is not None:
                log = _read(logs[name])
                if ADDR_IN_USE in log:
                    raise PortTaken(f"{name} could not bind its inbox {log.splitlines()[-1:]}")
                raise AssertionError(f"{name} exited with {p.returncode} at start-up:\n{log}")


def _read(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")
