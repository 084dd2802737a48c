"""A transport whose native engine cannot load is refused by the CLI in one line that names
the fix, before any worker starts (not an ImportError in a worker's log).

The missing library is made real, not mocked: the test runs the CLI in a subprocess whose
`sys.path` starts with a folder holding a `mooncake` package that fails to import the way
the real one does without Debian's libibverbs1 (its loader's OSError surfaces as an
ImportError naming the library).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfence.transfer.native import missing_native

BROKEN = (
    "raise ImportError('libibverbs.so.1: cannot open shared object file: No such file or "
    "directory')\n"
)


def broken_env(tmp_path: Path) -> dict[str, str]:
    pkg = tmp_path / "shadow" / "mooncake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text(BROKEN)
    path = os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def kvfence(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvfence", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize(
    "args",
    [
        ["lab", "matrix", "--topology", "sglang-router", "--transport", "mooncake"],
        ["serve", "--disaggregated", "--transport", "mooncake", "--port", "0"],
    ],
)
def test_a_transport_that_cannot_load_is_one_line_naming_the_fix(
    args: list[str], tmp_path: Path
) -> None:
    done = kvfence(args, broken_env(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "libibverbs" in done.stderr and "make pd" in done.stderr, done.stderr
    assert "--transport tcp" in done.stderr, done.stderr


def test_transports_without_a_native_engine_need_nothing() -> None:
    assert missing_native("tcp") is None
    assert missing_native("shm") is None
