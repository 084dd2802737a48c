"""`kvfence serve` start-up: spawn until ready, against a baseline revision, interleaved in one run.

Seeded (the embedded tiny checkpoint, seed 0). A baseline revision
(`--baseline`, default `main`) is checked out with `git worktree`; then, in
turn, each tree's `kvfence serve` (the embedded default: tiny checkpoint,
in-process pipeline, loopback, port 0) is spawned in a fresh interpreter with
`PYTHONPATH` at that tree's `src/`, and timed until it prints its URL
(`url_s`), until `/health` answers 200 (`ready_s`, the goal: 2 s) and until a
first completion answers 200 with content (`first_completion_s`). In the
same run: a bare `import torch` (the floor every role that holds a model
pays) and `kvfence --help` (goal 0.3 s).

Prints one line per tree with medians, and the load average:

  serve_ready tree=new ready_s=... url_s=... first_completion_s=... repeats=... load1=...
  serve_ready ratio new/baseline ready=... torch_import_s=... help_s=... load1=...

Usage: python bench/serve_ready.py [--baseline main] [--repeats 5] [--no-baseline]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
URL = re.compile(r"kvfence serving \S+ at (http://\S+)")
KEY = re.compile(r"tenant tenant-a: key (\S+)")


def load1() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a live process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_serve(src: Path) -> tuple[float, float, float, float]:
    """(url_s, ready_s, first_completion_s, ready_cpu_s) of one `kvfence serve` from `src`."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfence", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(src),
    )
    try:
        url, key = _announced(proc)
        url_s = time.perf_counter() - start
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.005)
        ready_s = time.perf_counter() - start
        ready_cpu = cpu_s(proc.pid)
        body = {"model": "tiny-seed0", "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(
            url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        if r.status_code != 200 or not r.json()["choices"][0]["text"]:
            raise SystemExit(f"first completion from {src}: HTTP {r.status_code} {r.text[:300]}")
        return url_s, ready_s, time.perf_counter() - start, ready_cpu
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _announced(proc: subprocess.Popen[str]) -> tuple[str, str]:
    assert proc.stdout is not None
    url = key = None
    for line in proc.stdout:
        key = key or (m.group(1) if (m := KEY.search(line)) else None)
        url = url or (m.group(1) if (m := URL.search(line)) else None)
        if url and key:
            return url, key
    raise SystemExit(f"kvfence serve exited {proc.wait()} before announcing its URL and key")


def time_cmd(argv: list[str], src: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=_env(src), check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="git revision to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-ready-") as tmp:
        trees = {"new": ROOT / "src"}
        base = Path(tmp) / "baseline"
        if not args.no_baseline:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base),
                 args.baseline],
                check=True,
            )  # fmt: skip
            trees = {"baseline": base / "src", **trees}
        try:
            report(trees, args.repeats)
        finally:
            if not args.no_baseline:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                    check=False,
                )


def report(trees: dict[str, Path], repeats: int) -> None:
    times: dict[str, list[tuple[float, float, float]]] = {n: [] for n in trees}
    torch_s: list[float] = []
    help_s: list[float] = []
    new = trees["new"]
    for _ in range(repeats):
        for name, src in trees.items():
            times[name].append(time_serve(src))
        torch_s.append(time_cmd([sys.executable, "-c", "import torch"], new))
        help_s.append(time_cmd([sys.executable, "-m", "kvfence", "--help"], new))
    ready = {}
    for name, rows in times.items():
        url_s, ready_s, first_s = (statistics.median(col) for col in zip(*rows, strict=True))
        ready[name] = ready_s
        print(
            f"serve_ready tree={name} ready_s={ready_s:.2f} url_s={url_s:.2f} "
            f"first_completion_s={first_s:.2f} goal<=2s repeats={repeats} load1={load1()}",
            flush=True,
        )
    ratio = (
        f"ratio new/baseline ready={ready['new'] / ready['baseline']:.2f} "
        if ("baseline" in ready)
        else ""
    )
    print(
        f"serve_ready {ratio}torch_import_s={statistics.median(torch_s):.2f} "
        f"help_s={statistics.median(help_s):.2f} load1={load1()}",
        flush=True,
    )


if __name__ == "__main__":
    main()
