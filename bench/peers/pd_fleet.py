"""A real vLLM prefill/decode fleet on loopback: two vLLM CPU servers with NixlConnector, vllm-router in front.

    with start_vllm_pd(ckpt_dir, log_dir=...) as fleet:
        fleet.url            # vllm-router (the tenants' address)
        fleet.prefill.url    # the prefill server's own OpenAI API (kv_producer)
        fleet.decode.url     # the decode server's own OpenAI API (kv_consumer)

KV moves from prefill to decode over NIXL (UCX over DRAM, `kv_buffer_device: cpu`); the
servers find each other's NIXL agents over a side channel whose host and port each server
reads from its environment, so every server gets its own port. vllm-router takes a request,
sends it to prefill with `kv_transfer_params: {do_remote_decode: true}` and `max_tokens: 1`,
and hands the reference prefill answers (engine id, host, port, block ids) to decode.

Each server spins while idle (NIXL's progress thread polls with no timeout), so each runs
on a core of its own: every thread of its process group is bound to that core once it is
ready (`pin_group`). vLLM's own binding (`VLLM_CPU_OMP_THREADS_BIND`) places only its OpenMP
team; the thread that runs prefill's model was measured on decode's core, beside decode's
worker and its spinning progress thread, while the API servers floated over both. That
fleet answered a 16-token prompt in 0.1 s or in 1-30 s, and an unrelated process sleeping
1 ms woke up to 30 s late; bound, its slowest wake-up was 0.01-0.19 s.
The pool is small on purpose (16 blocks of 128 tokens, the null block included), which is
what makes block reuse, and so the audit's questions about it, reachable in seconds.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvfence.startup_wait import StartupBounds

from .cache import PeerCache
from .server import PeerServer, PeerStartError, free_port, launch_server, start_vllm

PD_BLOCKS = 16  # per server, 128 tokens each; one is vLLM's null block
PD_MAX_MODEL_LEN = 1024  # (16 - 1) x 128 = 1,920 tokens hold one request of this length


@dataclass
class VllmPdFleet:
    """The three processes; `stop()` ends all of them (each in its own process group)."""

    prefill: PeerServer
    decode: PeerServer
    router: PeerServer

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def model(self) -> str:
        return self.router.model

    @property
    def servers(self) -> tuple[PeerServer, ...]:
        return (self.router, self.prefill, self.decode)

    def stop(self) -> None:
        for server in self.servers:
            server.stop(grace=10.0)

    def __enter__(self) -> VllmPdFleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _start_role(
    role: str,
    model_dir: Path,
    served: str,
    cpu: str,
    blocks: int,
    max_model_len: int,
    log_dir: Path,
    cache: PeerCache,
    kv_lease_s: int | None,
) -> PeerServer:
    transfer: dict[str, object] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
    }
    if kv_lease_s is not None:
        # Both sides read it: prefill holds a request's blocks this long after its prefill,
        # and decode's heartbeats (every lease // 6 s) extend that hold by lease * 2 // 3.
        transfer["kv_connector_extra_config"] = {"kv_lease_duration": kv_lease_s}
    return start_vllm(
        model_dir,
        served_model_name=served,
        num_gpu_blocks_override=blocks,
        max_model_len=max_model_len,
        enforce_eager=True,
        # float32, the checkpoint's own dtype: vLLM's CPU default (bfloat16) picks the AMX
        # attention kernel on AMX machines, and a decode step over KV pulled from prefill
        # died there with SIGILL (vLLM 0.32, Sapphire Rapids-class Xeon).
        dtype="float32",
        omp_threads_bind=cpu,
        extra_args=("--kv-transfer-config", json.dumps(transfer)),
        extra_env={
            "PYTHONPATH": str(cache.nixl_dir),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        },
        name=f"vllm-{role}",
        log_dir=log_dir,
        cache=cache,
        wait=False,
    )


def start_vllm_pd(
    model_dir: str | Path,
    *,
    served_model_name: str | None = None,
    blocks: int = PD_BLOCKS,
    max_model_len: int = PD_MAX_MODEL_LEN,
    startup: StartupBounds | None = None,
    log_dir: Path | None = None,
    cache: PeerCache | None = None,
    kv_lease_s: int | None = None,
) -> VllmPdFleet:
    """Start prefill and decode together (each waits on its own /v1/models), then vllm-router.

    `kv_lease_s` sets NixlConnector's `kv_lease_duration` on both servers (vLLM's default
    is 30 s): how long prefill keeps a request's blocks for decode to read. At 1 s the
    heartbeats extend nothing (1 * 2 // 3 = 0), so a decode that reads later reads blocks
    prefill has already freed.

    Each wait follows its server (`startup` bounds how long it may go without progress, and
    in all); a server that exits, stalls or outlasts the cap raises PeerStartError with its
    command, the load average and the tail of its log.
    """
    cache = cache or PeerCache.from_env()
    cache.require("vllm")
    if not cache.nixl_installed():
        raise PeerStartError(
            f"NIXL is not installed in {cache.nixl_dir}; run `make peers` (bench/peers/install.sh)"
        )
    model_path = Path(model_dir).resolve()
    served = served_model_name or model_path.name
    logs = log_dir or cache.run_dir / "logs"
    usable = sorted(os.sched_getaffinity(0))  # the cores this process may use, not all there are
    cpus = {"prefill": str(usable[0]), "decode": str(usable[min(1, len(usable) - 1)])}
    # Both start now and load side by side; each is then awaited on its own readiness.
    started = {
        role: _start_role(
            role, model_path, served, cpus[role], blocks, max_model_len, logs, cache, kv_lease_s
        )
        for role in ("prefill", "decode")
    }
    try:
        for server in started.values():
            server.ready_s = server.wait_ready(startup)
    except BaseException:
        for server in started.values():
            server.stop(grace=5.0)
        raise
    for role, server in started.items():
        pin_group(server.pid, int(cpus[role]))
    try:
        router = _start_router(started["prefill"], started["decode"], served, logs, startup)
    except BaseException:
        for server in started.values():
            server.stop(grace=5.0)
        raise
    return VllmPdFleet(prefill=started["prefill"], decode=started["decode"], router=router)


def _start_router(
    prefill: PeerServer,
    decode: PeerServer,
    served: str,
    log_dir: Path,
    startup: StartupBounds | None,
) -> PeerServer:
    """vllm-router (the Rust router from PyPI, in this project's own venv) in P/D mode over NIXL."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm_router.launch_router",
        "--vllm-pd-disaggregation",
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        "--kv-connector",
        "nixl",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--policy",
        "round_robin",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return launch_server("vllm-router", cmd, env, port, served, "/health", log_dir, startup)


def pin_group(leader: int, cpu: int) -> None:
    """Bind every thread of every process in `leader`'s session (a peer runs in a session of
    its own) to `cpu`. Threads and processes started later inherit the binding from the one
    that starts them."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or _session(proc) != leader:
            continue
        for task in (proc / "task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), {cpu})
            except (ProcessLookupError, PermissionError, FileNotFoundError):
                continue  # a thread or process that ended meanwhile


def _session(proc: Path) -> int | None:
    """The session id of a /proc/PID entry (None once the process is gone)."""
    try:
        stat = (proc / "stat").read_text()
    except OSError:
        return None
    # Field 6 (session); the command name in field 2 may hold spaces and parentheses.
    return int(stat.rsplit(")", 1)[1].split()[3])
