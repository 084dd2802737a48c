"""The one start-up sequence (serve/serving.py): a failing gate ends the process unbound,
with the gate's code and message, and the backend stopped, whichever entry point runs it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvfence.engine.sizing import GateReport
from kvfence.serve.build import LocalSpec, PoolSizes, build_local
from kvfence.serve.config import EXIT_GATE, Capacity
from kvfence.serve.serving import Listen, Server, run_server
from kvfence.serve.tenants import TenantRegistry

KVFENCE = str(Path(sys.executable).parent / "kvfence")
SMALL_PREFILL = PoolSizes(prefill_pages=64, decode_pages=512)  # 1,024 tokens < 4,096 x 1.25
ENGINE_THREAD = "kvfence-engine"  # the in-process pipeline's stepping thread
WORKER_START_S = 240  # a worker process loads torch and the model: minutes on a busy host


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == ENGINE_THREAD and t.is_alive()]


def test_a_failing_gate_returns_its_code_unbound_unannounced_and_the_backend_stopped(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parts = build_local(LocalSpec(checkpoint, kind="mirror", pools=SMALL_PREFILL))
    server = Server(parts.pipeline, parts.loaded.tokenizer, parts.config, TenantRegistry.dev())
    announced: list[str] = []

    def announce(url: str, capacity: Capacity) -> None:
        announced.append(url)

    def hint(report: GateReport) -> str:
        return f"hint: {report.pool_tokens} tokens"

    assert _engine_threads() == []
    # An address nothing can bind: a sequence that bound before the gate would raise here.
    rc = run_server(server, Listen("203.0.113.1", 1), announce, gate_hint=hint)
    assert rc == EXIT_GATE == 1
    assert announced == []
    err = capsys.readouterr().err
    assert "capacity gate FAIL" in err and "1,024 tokens" in err
    assert "hint: 1024 tokens" in err  # after the gate's own message
    assert err.index("capacity gate FAIL") < err.index("hint:")
    assert _engine_threads() == [], "the backend's thread outlived a refused start"


def test_an_sglang_worker_whose_pool_fails_the_gate_exits_unannounced(
    checkpoint: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a" * 32)
    argv = [KVFENCE, "serve", "--router", "sglang", "--role", "prefill"]
    argv += ["--model", str(checkpoint), "--kv-pages", "64", "--router-secret-file", str(secret)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=WORKER_START_S)
    assert done.returncode == EXIT_GATE, done.stderr
    assert "capacity gate FAIL" in done.stderr and "1,024 tokens" in done.stderr
    assert "KVFENCE_SGLANG_WORKER" not in done.stdout  # nothing listens, nothing announced
