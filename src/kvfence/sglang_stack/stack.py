"""The real PD stack on loopback: sglang-router in PD mode in front of kvfence workers.

Tenants reach the stack at kvfence's edge (edge.py) on the public host and port; the
router listens on a private loopback port only, because it serves its control plane
(worker listing, registration, removal) on the port it serves inference on. Its control
plane there also requires the operator key (`--control-plane-api-keys`, admin role):
`Stack.admin_url` with `Authorization: Bearer <Stack.admin_key>`.

Workers start (each binds port 0 and announces its URL and bootstrap port on
stdout, `worker.ANNOUNCE`); sglang-router is started beside them (`router_main`:
sglang-router's own arguments and Rust router, loaded while the workers load
their models) and, once every worker has announced, handed `--pd-disaggregation
--prefill URL/r/<secret> PORT … --decode URL/r/<secret> …` on its stdin. The
router credential (the secret path, gate.py) is
drawn here and handed to the workers in a 0600 file. All are supervised
together: one dies, or Ctrl-C, and every other one stops, with a message
naming which ended (serve/supervisor.py).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from kvfence.serve.admission import BODY_FLOOR
from kvfence.serve.supervisor import Supervisor, free_port, spawn
from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.cores import CoreShareSpec
from kvfence.sglang_stack.edge_main import ANNOUNCE as EDGE_ANNOUNCE
from kvfence.sglang_stack.edge_main import EdgeArgs
from kvfence.sglang_stack.gate import router_url
from kvfence.sglang_stack.router_main import ARGS_ON_STDIN
from kvfence.startup_wait import Probe, StartupBounds, StartupFailed, wait_started

ANNOUNCE = "KVFENCE_SGLANG_WORKER "  # worker.ANNOUNCE (kept torch-free here)
PRIVATE_HOST = "127.0.0.1"  # the router's own listener: reached by the edge and the operator


# sglang-router (0.3.2) answers a decode worker's 429 (one tenant over its admission limits)
# as a 500, counts it against both workers' circuit breakers and retries it (it retries 408,
# 429 and 5xx): one tenant's flood of refusals opened every circuit, and every tenant got 503
# "all circuits open" until the breaker's timeout. A refusal is a tenant's fault, not the
# worker's, so the breaker never opens (u32::MAX failures, its documented way off) and a
# request is tried once; a dead worker is still taken out by the router's health checks.
# Given before `StackSpec.router_args`, which may override them (argparse: the last wins).
ROUTER_FAILURE_ARGS = ("--cb-failure-threshold", str(2**32 - 1), "--retry-max-retries", "1")


class StackError(RuntimeError):
    """A part of the stack did not come up; the message names it and quotes its log."""


@dataclass(frozen=True, slots=True)
class StackSpec:
    worker_args: tuple[str, ...]  # `kvfence serve` options every worker gets (model, pools, faults)
    tenants_file: Path
    n_prefill: int = 1
    n_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 0  # the public (edge's) port; 0 = a free one
    router_args: tuple[str, ...] = ()
    # Each part's start-up wait follows it (its log, its CPU time), see kvfence.startup_wait.
    startup: StartupBounds = field(default_factory=lambda: StartupBounds(poll_s=0.02))
    # False: the router itself on the public address with its control plane open, as
    # sglang-router ships; only to measure the edge and to show what it prevents (tests).
    edge: bool = True
    # False: the router's loopback control plane takes no key. For an audit that reads
    # `/workers` there with a tenant key (the audit sends its operator key only on the
    # operator-data paths); the tenants' address is the edge either way.
    keyed_control_plane: bool = True
    # True: the workers, all on this host, take turns on its cores (cores.py), each step on
    # every free core. False: each keeps `--torch-threads` and all step at once (the fixed
    # split, for comparison: docs/BENCHMARKS.md).
    share_cores: bool = True


@dataclass(frozen=True, slots=True)
class Worker:
    name: str
    role: str
    url: str  # the worker's own URL (tenants' direct path)
    bootstrap_port: int | None


@dataclass(slots=True)
class Stack:
    """`with Stack(spec) as stack:` … `stack.url` is the router; every process stops on exit."""

    spec: StackSpec
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvfence-sgl-")))
    supervisor: Supervisor = field(default_factory=lambda: Supervisor(children=()))
    workers: list[Worker] = field(default_factory=list)
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    url: str = ""  # the tenants' address (the edge's)
    admin_url: str = ""  # the router's own listener (loopback): its control plane is here
    admin_keys: tuple[str, ...] = ()  # the operator keys its control plane takes (edge only)

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        secret_file = self.workdir / "router.secret"
        secret_file.touch(mode=0o600)
        secret_file.write_text(self.secret)
        roles = ["prefill"] * self.spec.n_prefill + ["decode"] * self.spec.n_decode
        names = [f"{r}-{i}" for i, r in enumerate(roles)]
        for slot, (name, role) in enumerate(zip(names, roles, strict=True)):
            env = self._core_share(slot, len(roles))
            self._spawn(name, self._worker_argv(role, secret_file), env)
        router = [sys.executable, "-m", "kvfence.sglang_stack.router_main", ARGS_ON_STDIN]
        self._spawn("sglang-router", router, stdin=subprocess.PIPE)
        if self.spec.edge:
            edge = [sys.executable, "-m", "kvfence.sglang_stack.edge_main", ARGS_ON_STDIN]
            self._spawn("edge", edge, stdin=subprocess.PIPE)
        self.workers = [self._announced(n, r) for n, r in zip(names, roles, strict=True)]
        if not self.spec.edge:
            port = self.spec.port or free_port(self.spec.host)
            self._hand("sglang-router", json.dumps(self._router_args(self.spec.host, port)))
            self.url = self.admin_url = f"http://{self.spec.host}:{port}"
            self._wait_registered()
            return
        self.admin_keys = self._operator_keys() if self.spec.keyed_control_plane else ()
        port = free_port(PRIVATE_HOST)
        self._hand("sglang-router", json.dumps(self._router_args(PRIVATE_HOST, port)))
        self.admin_url = f"http://{PRIVATE_HOST}:{port}"
        self._wait_registered()
        self._hand("edge", self._edge_args(secret_file).to_json())
        self.url = self._edge_announced()

    def router_url_of(self, worker: Worker) -> str:
        return router_url(worker.url, self.secret)

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def first_exit(self) -> tuple[str, int]:
        return self.supervisor.first_exit()

    def stop(self) -> None:
        self.supervisor.stop()

    # ---- parts -------------------------------------------------------------------------

    def _worker_argv(self, role: str, secret_file: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvfence",
            "serve",
            *self.spec.worker_args,
            "--router",
            "sglang",
            "--role",
            role,
            "--router-secret-file",
            str(secret_file),
            "--tenants",
            str(self.spec.tenants_file),
            "--host",
            self.spec.host,
            "--port",
            "0",
        ]

    def _core_share(self, slot: int, slots: int) -> dict[str, str]:
        if not self.spec.share_cores:
            return {}
        path = self.workdir / "cores"
        if slot == 0:
            CoreShareSpec.create(path, slots)
        return CoreShareSpec(str(path), slot, slots, os.cpu_count() or 1).to_env()

    def _operator_keys(self) -> tuple[str, ...]:
        """The tenants file's operator keys, else a fresh one: one operator credential."""
        keys = TenantRegistry.from_file(self.spec.tenants_file).operator_keys
        # The router's key list is `id:name:role:key`: a key with a colon cannot be one.
        usable = tuple(k for k in keys if ":" not in k)
        return usable or ("sk-operator-" + secrets.token_hex(16),)

    def _edge_args(self, secret_file: Path) -> EdgeArgs:
        import httpx

        def facts_of(worker: Worker) -> dict[str, Any]:
            url = f"{self.router_url_of(worker)}/server_info"
            return cast(dict[str, Any], httpx.get(url, timeout=30).json())

        decode = next(w for w in self.workers if w.role == "decode")
        facts = facts_of(decode)
        prefill = [facts_of(w) for w in self.workers if w.role == "prefill"]
        return EdgeArgs(
            host=self.spec.host,
            port=self.spec.port,
            router=self.admin_url,
            workers=tuple(w.url for w in self.workers),
            side=decode.url,
            model=str(facts["served_model_name"]),
            tenants_file=str(self.spec.tenants_file),
            secret_file=str(secret_file),
            # a worker's own body limit (Admission.body_limit): the edge refuses no body it takes
            body_limit=BODY_FLOOR + 32 * int(facts["context_length"]),
            # the tenants' default limits for the whole stack, from every prefill pool
            pool_tokens=sum(int(f["max_total_num_tokens"]) for f in prefill),
            longest=min(int(f["max_req_input_len"]) for f in prefill),
        )

    def _edge_announced(self) -> str:
        return str(self._line_after("edge", EDGE_ANNOUNCE, "its address")["url"])

    def _router_args(self, host: str, port: int) -> list[str]:
        argv = ["--pd-disaggregation"]
        for w in self.workers:
            if w.role == "prefill":
                argv += ["--prefill", self.router_url_of(w), str(w.bootstrap_port)]
            else:
                argv += ["--decode", self.router_url_of(w)]
        argv += ["--host", host, "--port", str(port), "--policy", "round_robin"]
        # Its Prometheus exporter binds a fixed default port otherwise (0 is refused).
        argv += ["--prometheus-host", host, "--prometheus-port", str(free_port())]
        argv += ROUTER_FAILURE_ARGS
        if self.admin_keys:
            # The control plane (every admin route, probed on 0.3.2) then needs one of these.
            argv.append("--control-plane-api-keys")
            argv += [
                f"operator-{i}:kvfence-operator:admin:{k}" for i, k in enumerate(self.admin_keys)
            ]
        return [*argv, *self.spec.router_args]

    def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        stdin: int | None = None,
    ) -> None:
        full_env = {**os.environ, **env} if env else None
        with (self.workdir / f"{name}.log").open("wb") as out:
            proc = spawn(argv, env=full_env, stdin=stdin, stdout=out, stderr=subprocess.STDOUT)
        self.supervisor.procs[name] = proc  # it ends with us (spawn)

    def _hand(self, name: str, line: str) -> None:
        """A child's arguments, on the stdin it waits on (`ARGS_ON_STDIN`)."""
        proc = self.supervisor.procs[name]
        assert proc.stdin is not None
        try:
            proc.stdin.write((line + "\n").encode())
            proc.stdin.close()
        except BrokenPipeError:
            self._check_alive(name)  # it ended: say how, with its log
            raise StackError(f"{name} closed its stdin before taking its arguments") from None

    def _announced(self, name: str, role: str) -> Worker:
        facts = self._line_after(name, ANNOUNCE, "its address")
        return Worker(name, role, facts["url"], facts["bootstrap_port"])

    def _line_after(self, name: str, prefix: str, what: str) -> dict[str, Any]:
        """The JSON a child prints after `prefix` once it listens, waiting as it starts."""
        found: list[dict[str, Any]] = []

        def probe() -> Probe:
            for line in self.log(name).splitlines():
                if line.startswith(prefix):
                    found.append(json.loads(line[len(prefix) :]))
                    return Probe(True)
            return Probe(False)

        self._wait(name, f"{name} to announce {what}", probe)
        return found[0]

    def _wait_registered(self) -> None:
        import httpx  # here: importing it delayed every worker's spawn by ~0.1 s

        def probe() -> Probe:
            try:
                auth = {"Authorization": f"Bearer {self.admin_keys[0]}"} if self.admin_keys else {}
                r = httpx.get(f"{self.admin_url}/workers", headers=auth, timeout=2)
                listed = r.json().get("workers", [])
            except (httpx.HTTPError, ValueError) as e:
                return Probe(False, type(e).__name__)
            healthy = [w for w in listed if w.get("is_healthy")]
            stage = f"{len(healthy)} of {len(self.workers)} workers registered healthy"
            return Probe(len(healthy) == len(self.workers), stage)

        self._wait("sglang-router", "sglang-router to register every worker", probe)

    def _wait(self, name: str, what: str, probe: Callable[[], Probe]) -> None:
        proc = self.supervisor.procs[name]
        try:
            wait_started(what, proc, self.workdir / f"{name}.log", probe, self.spec.startup)
        except StartupFailed as e:
            raise StackError(str(e)) from e

    def _check_alive(self, name: str) -> None:
        rc = self.supervisor.procs[name].poll()
        if rc is not None:
            raise StackError(f"{name} exited with code {rc}:\n{self.log(name)[-3000:]}")
