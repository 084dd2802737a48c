"""`kvfence serve` start-up: spawn until ready, against a baseline revision, interleaved in one run.

Seeded (the embedded tiny checkpoint, seed 0). A baseline revision
(`--baseline`, default `main`) is checked out with `git worktree`; then, in
turn, each tree's `kvfence serve` (the embedded default: tiny checkpoint,
in-process pipeline, loopback, port 0) is spawned in a fresh interpreter with
`PYTHONPATH` at that tree's `src/`, and timed until it prints its URL
(`url_s`), until `/health` answers 200 (`ready_s`, the goal: 2 s) and until a
first completion answers 200 with content (`first_completion_s`).
`ready_cpu_s` is the CPU time (user + system, every thread, every process of
the server) spent until that 200: on a shared machine it moves far less with
the load than the wall times do. With `--disaggregated` the same is timed for
`kvfence serve --disaggregated` (sglang-router in front of a prefill and a
decode worker): ready is the router's URL line (printed once every worker is
registered) and the router's /health, the first completion goes through it.
In the same run: a bare `import torch` (the floor every role that holds a
model pays) and `kvfence --help` (goal 0.3 s).

Prints one line per tree with medians, and the load average:

  serve_ready mode=single tree=new ready_s=... url_s=... first_completion_s=... ready_cpu_s=...
  serve_ready mode=single ratio new/baseline ready=... ready_cpu=... torch_import_s=... help_s=...

Usage: python bench/serve_ready.py [--baseline main] [--repeats 5] [--no-baseline]
                                   [--disaggregated]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
URL = re.compile(r"(?:kvfence serving \S+|sglang-router \(PD mode\)) at (http://\S+)")
KEY = re.compile(r"tenant tenant-a: key (\S+)")


def load1() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a live process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of a live process and all its live descendants."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue  # gone meanwhile
    tree, frontier = {root}, [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(kids)
        frontier = kids
    total = 0.0
    for pid in tree:
        try:
            total += cpu_s(pid)
        except OSError:
            continue
    return total


@dataclass(frozen=True, slots=True)
class Sample:
    url_s: float
    ready_s: float
    first_completion_s: float
    ready_cpu_s: float


def time_serve(src: Path, extra: tuple[str, ...]) -> Sample:
    """One `kvfence serve` (with `extra` options) from `src`, spawned until its first answer."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfence", "serve", "--port", "0", *extra],
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
        ready_cpu = tree_cpu_s(proc.pid)
        body = {"model": "tiny-seed0", "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(
            url + "/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        if r.status_code != 200 or not r.json()["choices"][0]["text"]:
            raise SystemExit(f"first completion from {src}: HTTP {r.status_code} {r.text[:300]}")
        return Sample(url_s, ready_s, time.perf_counter() - start, ready_cpu)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


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
    parser.add_argument(
        "--disaggregated", action="store_true", help="time `kvfence serve --disaggregated`"
    )
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
            report(trees, args.repeats, args.disaggregated)
        finally:
            if not args.no_baseline:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                    check=False,
                )


def report(trees: dict[str, Path], repeats: int, disaggregated: bool) -> None:
    mode, extra = ("disaggregated", ("--disaggregated",)) if disaggregated else ("single", ())
    times: dict[str, list[Sample]] = {n: [] for n in trees}
    torch_s: list[float] = []
    help_s: list[float] = []
    new = trees["new"]
    print(f"serve_ready mode={mode} trees={','.join(trees)} load1={load1()}", flush=True)
    for _ in range(repeats):
        for name, src in trees.items():
            times[name].append(time_serve(src, extra))
        torch_s.append(time_cmd([sys.executable, "-c", "import torch"], new))
        help_s.append(time_cmd([sys.executable, "-m", "kvfence", "--help"], new))
    med = {
        name: {f.name: statistics.median(getattr(r, f.name) for r in rows)
               for f in dataclasses.fields(Sample)}
        for name, rows in times.items()
    }  # fmt: skip
    for name, m in med.items():
        print(
            f"serve_ready mode={mode} tree={name} ready_s={m['ready_s']:.2f} "
            f"url_s={m['url_s']:.2f} first_completion_s={m['first_completion_s']:.2f} "
            f"ready_cpu_s={m['ready_cpu_s']:.2f} goal<=2s repeats={repeats} load1={load1()}",
            flush=True,
        )
    ratio = ""
    if "baseline" in med:
        new_m, base_m = med["new"], med["baseline"]
        ratio = (
            f"ratio new/baseline ready={new_m['ready_s'] / base_m['ready_s']:.2f} "
            f"ready_cpu={new_m['ready_cpu_s'] / base_m['ready_cpu_s']:.2f} "
        )
    print(
        f"serve_ready mode={mode} {ratio}torch_import_s={statistics.median(torch_s):.2f} "
        f"help_s={statistics.median(help_s):.2f} load1={load1()}",
        flush=True,
    )


if __name__ == "__main__":
    main()
