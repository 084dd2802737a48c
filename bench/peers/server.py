"""Start, wait for and stop a real peer engine (vLLM CPU, llama-server) on loopback.

Every peer runs in its own process group (start_new_session) so `stop()` ends it and the
helpers it spawned (vLLM's engine core) by the group's id, and nothing else.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvfence.serve.supervisor import free_port as free_port  # drawn below the ephemeral range
from kvfence.startup_wait import Probe, StartupBounds, StartupFailed, wait_started

from .cache import PeerCache
from .gguf import convert_to_gguf

HOST = "127.0.0.1"
_VLLM_POOL_RE = re.compile(r"CPU KV cache size:\s*([\d,]+)\s*tokens")
_LLAMA_N_CTX_RE = re.compile(r"llama_context:\s+n_ctx\s*=\s*(\d+)")
_LLAMA_N_CTX_SEQ_RE = re.compile(r"llama_context:\s+n_ctx_seq\s*=\s*(\d+)")
_LLAMA_SLOTS_RE = re.compile(
    r"n_slots\s*=\s*(\d+),\s*n_ctx_slot\s*=\s*(\d+),\s*kv_unified\s*=\s*'?(true|false)"
)


class PeerStartError(RuntimeError):
    """The peer exited, stalled or outlasted the cap before it was ready; the message says
    which, with the load average and the log's end."""


def vllm_pool_tokens(log: str) -> int | None:
    """The KV pool vLLM sized at start-up ("CPU KV cache size: N tokens"), or None."""
    found = _VLLM_POOL_RE.findall(log)
    return int(found[-1].replace(",", "")) if found else None


@dataclass(frozen=True, slots=True)
class LlamaSlotLayout:
    """llama-server's start-up line: `n_slots = N, n_ctx_slot = C, kv_unified = 'B'`.

    With kv_unified the slots share ONE pool of n_ctx_slot tokens (the pool trap); without
    it each slot owns n_ctx_slot. This is the only place the mode is told.
    """

    n_slots: int
    n_ctx_slot: int
    kv_unified: bool

    @property
    def pool_tokens(self) -> int:
        return self.n_ctx_slot if self.kv_unified else self.n_ctx_slot * self.n_slots


def llamacpp_slot_layout(log: str) -> LlamaSlotLayout | None:
    """The slot layout llama-server printed at start-up, or None."""
    found = _LLAMA_SLOTS_RE.findall(log)
    if not found:
        return None
    n_slots, n_ctx_slot, unified = found[-1]
    return LlamaSlotLayout(int(n_slots), int(n_ctx_slot), unified == "true")


def llamacpp_n_ctx(log: str) -> int | None:
    """The context (KV pool, all slots together) llama.cpp allocated, or None.

    From `llama_context: n_ctx = N` when verbose logging printed it, else from the slot layout.
    """
    found = _LLAMA_N_CTX_RE.findall(log)
    if found:
        return int(found[-1])
    layout = llamacpp_slot_layout(log)
    return layout.pool_tokens if layout else None


def llamacpp_n_ctx_seq(log: str) -> int | None:
    """The per-sequence (per-slot) context llama.cpp printed, or None."""
    found = _LLAMA_N_CTX_SEQ_RE.findall(log)
    if found:
        return int(found[-1])
    layout = llamacpp_slot_layout(log)
    return layout.n_ctx_slot if layout else None


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) for a GET; HTTP errors are answers, not exceptions."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()


@dataclass
class PeerServer:
    """A running peer. `url` is the base (no /v1); `model` is the name requests must send."""

    name: str
    url: str
    port: int
    model: str
    log_path: Path
    cmd: list[str]
    process: subprocess.Popen[bytes]
    ready_path: str
    ready_s: float | None = field(default=None)

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, bounds: StartupBounds | None = None) -> float:
        """Poll `ready_path` until 200 while the peer makes progress; return the seconds waited.

        Raise PeerStartError (with the command and the log's end) when the peer exits,
        stalls or outlasts the cap (kvfence.startup_wait).
        """

        def probe() -> Probe:
            with contextlib.suppress(OSError):
                status, _ = http_get(self.url + self.ready_path, timeout=2.0)
                return Probe(status == 200, f"HTTP {status}")
            return Probe(False, "not listening")

        what = f"{self.name} at {self.url}{self.ready_path}"
        try:
            return wait_started(what, self.process, self.log_path, probe, bounds)
        except StartupFailed as err:
            raise PeerStartError(f"{err}\ncommand: {' '.join(self.cmd)}") from err

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM the peer's process group, SIGKILL it after `grace` s; return the exit code."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=grace)
        # Helpers left in the group (vLLM's engine core) die with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.returncode

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the starting process dies (PR_SET_PDEATHSIG).

    A killed test run must not leave a multi-GB vLLM behind; its own SIGTERM handler then
    takes its engine core down with it.
    """
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _clean_env() -> dict[str, str]:
    """The caller's environment minus anything that would leak this project's venv into a peer's."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    return {k: v for k, v in os.environ.items() if k not in drop}


def launch_server(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    port: int,
    model: str,
    ready_path: str,
    log_dir: Path,
    startup: StartupBounds | None = None,
    *,
    wait: bool = True,
) -> PeerServer:
    """Start `cmd` in its own session (dying with its starter), log to `log_dir`, wait for `ready_path`.

    `wait=False` returns at once; the caller then calls `wait_ready` itself (several peers
    starting side by side). Start peers from a thread that outlives them: the death signal
    (`_die_with_parent`) follows the starting thread, not the process.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    server = PeerServer(
        name=name,
        url=f"http://{HOST}:{port}",
        port=port,
        model=model,
        log_path=log_path,
        cmd=cmd,
        process=proc,
        ready_path=ready_path,
    )
    if not wait:
        return server
    try:
        server.ready_s = server.wait_ready(startup)
    except BaseException:
        server.stop(grace=5.0)
        raise
    return server


def start_vllm(
    model_dir: str | Path,
    port: int | None = None,
    *,
    served_model_name: str | None = None,
    kv_cache_gib: float = 1.0,
    num_gpu_blocks_override: int | None = None,
    max_model_len: int | None = None,
    enable_prompt_tokens_details: bool = True,
    enforce_eager: bool = True,
    dtype: str | None = None,
    omp_threads_bind: str | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    name: str = "vllm",
    startup: StartupBounds | None = None,
    wait: bool = True,
    log_dir: Path | None = None,
    cache: PeerCache | None = None,
) -> PeerServer:
    """Start vLLM's OpenAI server on `model_dir` (HF layout) and wait until /v1/models answers.

    `num_gpu_blocks_override` is the CPU pool in 128-token blocks despite its name; vLLM's
    own sizing from `kv_cache_gib` (VLLM_CPU_KVCACHE_SPACE) applies when it is None.
    """
    cache = cache or PeerCache.from_env()
    cache.require("vllm")
    port = port or free_port()
    model_path = Path(model_dir).resolve()
    served = served_model_name or model_path.name
    run = cache.run_dir
    for sub in ("vllm-cache", "vllm-rpc", "tmp"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    env = _clean_env() | {
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "VLLM_HOST_IP": HOST,
        "VLLM_CACHE_ROOT": str(run / "vllm-cache"),
        "VLLM_RPC_BASE_PATH": str(run / "vllm-rpc"),
        "TMPDIR": str(run / "tmp"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # Loopback only: no usage reports leave this machine.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if omp_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind
    env |= dict(extra_env or {})
    cmd = [
        str(cache.vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--served-model-name",
        served,
        "--host",
        HOST,
        "--port",
        str(port),
    ]
    if num_gpu_blocks_override is not None:
        cmd += ["--num-gpu-blocks-override", str(num_gpu_blocks_override)]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if enable_prompt_tokens_details:
        cmd.append("--enable-prompt-tokens-details")
    if enforce_eager:
        cmd.append("--enforce-eager")
    if dtype is not None:
        cmd += ["--dtype", dtype]
    cmd += list(extra_args)
    return launch_server(
        name,
        cmd,
        env,
        port,
        served,
        "/v1/models",
        log_dir or run / "logs",
        startup,
        wait=wait,
    )


def start_llamacpp(
    gguf_or_hf_dir: str | Path,
    port: int | None = None,
    *,
    alias: str | None = None,
    ctx_size: int | None = None,
    parallel: int | None = None,
    threads: int | None = None,
    metrics: bool = True,
    outtype: str = "f32",
    extra_args: Sequence[str] = (),
    startup: StartupBounds | None = None,
    log_dir: Path | None = None,
    cache: PeerCache | None = None,
) -> PeerServer:
    """Start llama-server on a GGUF file, or on an HF dir converted (and cached) first.

    With `parallel` (-np N) each slot gets ctx_size / N; without it the slots share one
    pool of ctx_size while each reports the whole of it (the pool trap in PEERS.md).
    """
    cache = cache or PeerCache.from_env()
    cache.require("llamacpp")
    port = port or free_port()
    src = Path(gguf_or_hf_dir).resolve()
    gguf = src if src.is_file() else convert_to_gguf(src, outtype=outtype, cache=cache)
    served = alias or (src.name if src.is_dir() else src.stem)
    cmd = [
        str(cache.llama_server),
        "-m",
        str(gguf),
        "--host",
        HOST,
        "--port",
        str(port),
        "--alias",
        served,
        "--no-webui",
    ]
    if metrics:
        cmd.append("--metrics")
    if ctx_size is not None:
        cmd += ["-c", str(ctx_size)]
    if parallel is not None:
        cmd += ["-np", str(parallel)]
    if threads is not None:
        cmd += ["-t", str(threads)]
    cmd += list(extra_args)
    return launch_server(
        "llamacpp",
        cmd,
        _clean_env(),
        port,
        served,
        "/health",
        log_dir or cache.run_dir / "logs",
        startup,
    )
