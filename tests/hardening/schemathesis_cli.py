"""`schemathesis run --checks all` against a live server's /openapi.json, as CI runs it.

Shared by every mode's fuzz test (single process, the hub, the sglang-router
stack): pass the server's URL and a tenant key. The run is bounded by
`examples` per operation and a fixed seed. Its config puts 400 among
positive_data_acceptance's expected statuses, and `schemathesis_hooks` adds
the stricter check that takes its place for 400s (only the limits the
operation lists as beyond the schema).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = """\
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429"]
"""
RUN_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Run:
    returncode: int
    output: str

    @property
    def summary(self) -> str:
        """Each failure (at most 150 lines of them) and the closing counts, for the test's log."""
        lines = self.output.rstrip().splitlines()
        first = next((i for i, line in enumerate(lines) if "FAILURES" in line), len(lines))
        return "\n".join([*lines[first : first + 150], "...", *lines[-25:]])


def checks_all(base_url: str, key: str, examples: int, workdir: Path, seed: int = 1) -> Run:
    """Every check schemathesis has, every phase that applies; returns its exit code and output."""
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    exe = Path(sys.executable).with_name("schemathesis")
    argv = [str(exe), "--config-file", str(config), "run", f"{base_url}/openapi.json",
            "-H", f"Authorization: Bearer {key}", "--checks", "all",
            "--max-examples", str(examples), "--seed", str(seed), "--workers", "1",
            "--phases", "examples,coverage,fuzzing,stateful", "--no-color"]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
    }
    done = subprocess.run(
        argv, env=env, cwd=workdir, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    return Run(done.returncode, done.stdout + done.stderr)
