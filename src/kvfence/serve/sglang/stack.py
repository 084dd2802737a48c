"""The real PD stack on loopback: sglang-router in PD mode in front of kvfence workers.

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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvfence.serve.sglang.gate import router_url
from kvfence.serve.sglang.router_main import ARGS_ON_STDIN
from kvfence.serve.supervisor import Supervisor, free_port, spawn

ANNOUNCE = "KVFENCE_SGLANG_WORKER "  # worker.ANNOUNCE (kept torch-free here)


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
    port: int = 0  # the router's public port; 0 = a free one
    router_args: tuple[str, ...] = ()
    startup_timeout_s: float = 180.0
    worker_env: tuple[tuple[str, str], ...] = ()  # extra environment for the workers (lab hooks)


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
    url: str = ""

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
        for name, role in zip(names, roles, strict=True):
            self._spawn(name, self._worker_argv(role, secret_file), dict(self.spec.worker_env))
        router = [sys.executable, "-m", "kvfence.serve.sglang.router_main", ARGS_ON_STDIN]
        self._spawn("sglang-router", router, stdin=subprocess.PIPE)
        deadline = time.monotonic() + self.spec.startup_timeout_s
        self.workers = [self._announced(n, r, deadline) for n, r in zip(names, roles, strict=True)]
        port = self.spec.port or free_port(self.spec.host)
        self._hand_router(self._router_args(port))
        self.url = f"http://{self.spec.host}:{port}"
        self._wait_registered(deadline)

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

    def _router_args(self, port: int) -> list[str]:
        argv = ["--pd-disaggregation"]
        for w in self.workers:
            if w.role == "prefill":
                argv += ["--prefill", self.router_url_of(w), str(w.bootstrap_port)]
            else:
                argv += ["--decode", self.router_url_of(w)]
        argv += ["--host", self.spec.host, "--port", str(port), "--policy", "round_robin"]
        # Its Prometheus exporter binds a fixed default port otherwise (0 is refused).
        argv += ["--prometheus-host", self.spec.host, "--prometheus-port", str(free_port())]
        argv += ROUTER_FAILURE_ARGS
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

    def _hand_router(self, args: list[str]) -> None:
        """The router's arguments, on the stdin it waits on (router_main.ARGS_ON_STDIN)."""
        proc = self.supervisor.procs["sglang-router"]
        assert proc.stdin is not None
        try:
            proc.stdin.write((json.dumps(args) + "\n").encode())
            proc.stdin.close()
        except BrokenPipeError:
            self._check_alive("sglang-router")  # it ended: say how, with its log
            raise StackError("sglang-router closed its stdin before taking its arguments") from None

    def _announced(self, name: str, role: str, deadline: float) -> Worker:
        while time.monotonic() < deadline:
            for line in self.log(name).splitlines():
                if line.startswith(ANNOUNCE):
                    facts: dict[str, Any] = json.loads(line[len(ANNOUNCE) :])
                    return Worker(name, role, facts["url"], facts["bootstrap_port"])
            self._check_alive(name)
            time.sleep(0.02)  # a log read: the stack's start-up waits on this poll
        raise StackError(f"{name} did not start in time:\n{self.log(name)[-3000:]}")

    def _wait_registered(self, deadline: float) -> None:
        import httpx  # here: importing it delayed every worker's spawn by ~0.1 s

        while time.monotonic() < deadline:
            self._check_alive("sglang-router")
            try:
                listed = httpx.get(f"{self.url}/workers", timeout=2).json().get("workers", [])
                healthy = [w for w in listed if w.get("is_healthy")]
                if len(healthy) == len(self.workers):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        raise StackError(
            f"sglang-router did not register every worker:\n{self.log('sglang-router')[-3000:]}"
        )

    def _check_alive(self, name: str) -> None:
        rc = self.supervisor.procs[name].poll()
        if rc is not None:
            raise StackError(f"{name} exited with code {rc}:\n{self.log(name)[-3000:]}")
