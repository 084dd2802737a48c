"""How long `kvfence lab replay` takes, servers included (target: under 30 s wall on 2 cores).

Seeded (`--seed`, fixed A sentinel and traffic). Each repeat runs the whole
command as a user would, `python -m kvfence lab replay --seed S --checkpoint C`,
in a fresh interpreter: imports, both servers (incident profile, then
hardened) started and stopped, A's and B's traffic, the table. The same
command is also run in-process (click's runner, imports already paid) in the
same run, and a fresh interpreter that only imports the command, so the line
shows how much of the wall time is the interpreter and imports rather than
the replay itself. The tiny checkpoint is made once up
front (the embedded default is made on first use and then cached) and its
cost is reported apart. Every run must exit 0 (the leak reproduced as
expected), or the benchmark fails.

Prints one line:

  lab_replay_wall_s=... in_process_s=... import_only_s=... target<30s ratio=... load1=...

ratio = lab_replay_wall_s / 30 (below 1.0 meets the target). load1 is the
1-minute load average at the end, since other work on the machine inflates
wall time.

Usage: python bench/lab_replay.py [--repeats 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from click.testing import CliRunner

from kvfence.cli import main as kvfence_main
from kvfence.model.tiny import make_tiny_checkpoint

TARGET_S = 30.0


def replay_args(seed: int, checkpoint: Path) -> list[str]:
    return ["lab", "replay", "--seed", str(seed), "--checkpoint", str(checkpoint)]


def subprocess_wall(seed: int, checkpoint: Path) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kvfence", *replay_args(seed, checkpoint)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"kvfence lab replay exited {done.returncode}:\n{done.stdout}{done.stderr}"
        )
    return wall


def import_wall() -> float:
    """A fresh interpreter that only imports the `kvfence` command (what every run pays first)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import kvfence.cli"], check=True)
    return time.perf_counter() - start


def in_process_wall(seed: int, checkpoint: Path) -> float:
    start = time.perf_counter()
    result = CliRunner().invoke(kvfence_main, replay_args(seed, checkpoint))
    wall = time.perf_counter() - start
    if result.exit_code != 0:
        raise SystemExit(f"in-process replay exited {result.exit_code}:\n{result.output}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-") as tmp:
        start = time.perf_counter()
        checkpoint = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        checkpoint_s = time.perf_counter() - start
        walls = [subprocess_wall(args.seed, checkpoint) for _ in range(args.repeats)]
        in_proc = [in_process_wall(args.seed, checkpoint) for _ in range(args.repeats)]
        imports = [import_wall() for _ in range(args.repeats)]
    wall = statistics.median(walls)
    print(
        f"lab_replay_wall_s={wall:.2f} (median of {args.repeats}, subprocess; "
        f"runs {' '.join(f'{w:.2f}' for w in walls)}) "
        f"in_process_s={statistics.median(in_proc):.2f} import_only_s={statistics.median(imports):.2f} "
        f"checkpoint_once_s={checkpoint_s:.2f} "
        f"target<{TARGET_S:.0f}s ratio={wall / TARGET_S:.2f} load1={os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
