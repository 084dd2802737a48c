"""serve/startup.py: what shortens a server's start-up, and that it leaves the process as it was."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from kvfence.serve.startup import collector_paused, quiet_torch_import


def test_the_collector_is_off_inside_then_back_on_and_the_survivors_frozen() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with collector_paused():
            assert not gc.isenabled()
            kept = [[] for _ in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(kept)
    finally:
        gc.unfreeze()


def test_a_collector_the_caller_had_off_stays_off_also_after_an_error() -> None:
    gc.disable()
    try:
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("build failed")
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()


def test_torch_plugin_autoload_is_off_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    quiet_torch_import()
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    quiet_torch_import()
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1"


def test_the_single_server_path_imports_neither_fastapi_nor_pydantic() -> None:
    # Their import (pydantic schemas for FastAPI's own OpenAPI classes) was about a tenth
    # of a server's start-up, for features kvfence does not use (bench/serve_ready.py).
    code = (
        "import sys\n"
        "import kvfence.launch.cli, kvfence.serve.build, kvfence.serve.app, kvfence.serve.thread\n"
        "import kvfence.sglang_stack.worker\n"
        "print(sorted(m for m in ('fastapi', 'pydantic') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "[]", out
