"""Start-up waits follow the server: real processes that start slowly, silently, die or hang.

Each "server" is a small Python script run as its own process, awaited through the peer
kit's `launch_server` (the path every peer and benchmark server takes) with a stall window
of a few seconds, so a fixed deadline of that size would fail the slow-but-working ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfence.serve.supervisor import free_port
from kvfence.startup_wait import StartupBounds, StartupFailed, log_tail, tree_cpu_s

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.peers import PeerServer, PeerStartError, launch_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STALL_S = 4.0
# Every script listens (when it does) with the standard library's HTTP server.
SERVE = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
print("listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
# Logs a line every 0.5 s for 3 stall windows, then listens: slow, but visibly progressing.
SLOW_LOGGER = f"""
import time
for i in range({int(3 * STALL_S / 0.5)}):
    print(f"loading shard {{i}}", flush=True)
    time.sleep(0.5)
{SERVE}
"""
# Prints one line, then computes silently for 3 stall windows (an import or a weight load
# at high load: however small its share of a core, it spends CPU time), then listens.
SILENT_WORKER = f"""
import time
print("importing", flush=True)
end = time.monotonic() + {3 * STALL_S}
while time.monotonic() < end:
    sum(range(10000))
{SERVE}
"""
DIES = """
print("loading the model", flush=True)
raise SystemExit("model file is corrupt: expected 12 layers, found 11")
"""
# Prints, then blocks for good: no output, no CPU.
HANGS = """
import threading
print("waiting for the engine core", flush=True)
threading.Event().wait()
"""
# Busy for ever and never listens: only the cap ends it.
SPINS = """
print("spinning", flush=True)
while True:
    sum(range(10000))
"""


def _launch(tmp: Path, name: str, script: str, bounds: StartupBounds) -> PeerServer:
    path = tmp / f"{name}.py"
    path.write_text(script)
    port = free_port()
    cmd = [sys.executable, str(path), str(port)]
    return launch_server(name, cmd, dict(os.environ), port, name, "/health", tmp, bounds)


def test_a_slow_server_that_keeps_logging_is_awaited(tmp_path: Path) -> None:
    with _launch(tmp_path, "slow", SLOW_LOGGER, StartupBounds(stall_s=STALL_S)) as server:
        assert server.ready_s is not None and server.ready_s > 2 * STALL_S
        assert "loading shard" in server.log_text()


def test_a_silent_server_spending_cpu_is_awaited(tmp_path: Path) -> None:
    with _launch(tmp_path, "silent", SILENT_WORKER, StartupBounds(stall_s=STALL_S)) as server:
        assert server.ready_s is not None and server.ready_s > 2 * STALL_S


def test_a_server_that_exits_fails_at_once_with_its_log(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(PeerStartError) as err:
        _launch(tmp_path, "dies", DIES, StartupBounds(stall_s=60.0, cap_s=600.0))
    # Well inside the stall window: the exit, not a deadline, ended the wait.
    assert time.monotonic() - t0 < 30.0
    text = str(err.value)
    assert "dies at http://127.0.0.1:" in text and "/health" in text
    assert "exited with 1 before it was ready" in text
    assert "model file is corrupt: expected 12 layers, found 11" in text
    assert "load average" in text and "s waiting" in text
    assert "command: " in text


def test_a_hung_server_fails_after_the_stall_window(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(PeerStartError) as err:
        _launch(tmp_path, "hangs", HANGS, StartupBounds(stall_s=STALL_S, cap_s=600.0))
    waited = time.monotonic() - t0
    assert STALL_S <= waited < STALL_S + 60.0
    text = str(err.value)
    assert f"stalled: no new log output, readiness stage or CPU time for {STALL_S:.0f} s" in text
    assert "last stage: not listening" in text
    assert "waiting for the engine core" in text  # the log's last line
    assert "load average" in text


def test_a_server_that_spins_for_ever_meets_the_cap(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(PeerStartError) as err:
        _launch(tmp_path, "spins", SPINS, StartupBounds(stall_s=STALL_S, cap_s=3 * STALL_S))
    assert time.monotonic() - t0 < 3 * STALL_S + 60.0
    assert f"not ready within the {3 * STALL_S:.0f} s cap" in str(err.value)


def test_bounds_refuse_a_stall_window_beyond_the_cap() -> None:
    with pytest.raises(ValueError, match="stall_s must be > 0 and <= cap_s"):
        StartupBounds(stall_s=10.0, cap_s=5.0)


def test_tree_cpu_counts_children(tmp_path: Path) -> None:
    """A parent that only waits on a busy child (vLLM's API server on its engine core) is
    credited with the child's CPU time."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'while True: sum(range(10000))'])\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        before = tree_cpu_s(proc.pid)
        own_before = tree_cpu_s(child)
        assert before is not None and own_before is not None
        deadline = time.monotonic() + 120.0  # the child needs 0.5 s of a core, however busy
        while (tree_cpu_s(child) or 0.0) - own_before < 0.5:
            assert time.monotonic() < deadline, "the spinning child got no CPU in 120 s"
            time.sleep(0.2)
        after = tree_cpu_s(proc.pid)
        assert after is not None and after - before >= 0.5
    finally:
        os.kill(child, signal.SIGKILL)
        proc.wait()
    assert tree_cpu_s(proc.pid) is None


def test_log_tail_reads_the_end(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert log_tail(log, lines=2) == "line 998\nline 999"
    assert log_tail(tmp_path / "absent.log") == ""


def test_failure_message_names_everything() -> None:
    err = StartupFailed("vllm at http://127.0.0.1:1/v1/models", "stalled", 12.3, "a\nb")
    text = str(err)
    assert text.startswith("vllm at http://127.0.0.1:1/v1/models: stalled after 12 s waiting")
    assert "load average" in text and text.endswith("last log lines:\na\nb")


def test_a_stack_whose_worker_dies_fails_at_once_naming_it(tmp_path: Path) -> None:
    """The sglang stack's start-up waits follow each part: a worker that exits at start ends
    the wait with its log, well inside the stall window, instead of waiting out a deadline."""
    from kvfence.sglang_stack.stack import Stack, StackError, StackSpec

    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"tenants": [{"name": "a", "keys": ["sk-tenant-a-0123456789"]}]}')
    spec = StackSpec(
        worker_args=("--model-kind", "mirror", "--kv-pages", "nonsense"),
        tenants_file=tenants,
        startup=StartupBounds(stall_s=120.0, cap_s=600.0),
    )
    t0 = time.monotonic()
    with pytest.raises(StackError) as err, Stack(spec, workdir=tmp_path):
        pass
    assert time.monotonic() - t0 < 60.0
    text = str(err.value)
    assert text.startswith("prefill-0 to announce its address: the process exited with")
    assert "--kv-pages" in text  # the worker's own complaint, from its log
    assert "load average" in text
