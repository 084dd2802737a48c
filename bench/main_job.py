"""The main job (`make demo`, bare `kvfence`) against a baseline revision, interleaved in one run.

Seeded (the main job's audit seed is fixed: 0). A baseline revision
(`--baseline`, default `main`) is checked out with `git worktree` into a
temporary folder; then the main job runs `--repeats` times from each tree in
turn (baseline, this tree, baseline, ...), each in a fresh interpreter with
`PYTHONPATH` pointing at that tree's `src/` (the servers it spawns inherit
it). Every run must exit 0 with the demo's verdicts (the lab FAILs capacity,
boundary, canary, noninterference and latency; the hardened engine passes
everything): a run with other verdicts is printed as NOT AS EXPECTED and
left out of the medians (a faster run with different verdicts is not a result).

Prints one line per run and one summary line:

  run tree=new i=0 wall_s=... runbook_s=... startup_s=... requests=... exit=0 load1=...
  main_job median_wall_s new=... baseline=... ratio=... (goal<=30s) runbook new=... baseline=... load1=...

`startup_s` is the time from the job's start until the runbook starts
(interpreter, gate report, both servers spawned and answering /health);
the remainder after the runbook is stopping the servers and writing reports.
The machine may be shared: only the ratio within one run is comparable.

Usage: python bench/main_job.py [--baseline main] [--repeats 3] [--no-baseline]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 30.0
# The demo as expected: (target index, check) -> verdict; index 0 is the lab, 1 the fix.
LAB_FAILS = ("capacity", "boundary", "canary", "noninterference", "latency")


@dataclass(frozen=True, slots=True)
class Run:
    wall_s: float
    runbook_s: float
    startup_s: float
    requests: int
    verdicts: tuple[tuple[str, str, str], ...]


def load1() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def run_main_job(src: Path, tally: dict[str, int] | None = None) -> Run | str:
    """One main job from `src`; a string says why it did not come out as the demo expects.
    `tally` counts, per "target check verdict", the verdicts seen (the 10-of-10 count)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kvfence"], capture_output=True, text=True, env=env, check=False
    )
    wall = time.perf_counter() - start
    found = re.search(r"HTML report: (\S+)", done.stdout)
    if found is None:
        raise SystemExit(
            f"the main job from {src} exited {done.returncode} with no report:\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    report = json.loads(Path(found.group(1)).with_name("report.json").read_text())
    urls = [t["url"] for t in report["targets"]]
    verdicts = tuple(
        (("lab", "hardened")[urls.index(r["target"])], r["check"], r["verdict"])
        for r in report["results"]
    )
    began = datetime.fromisoformat(report["started_at"]).timestamp()
    startup = began - (time.time() - wall)  # started_at has one-second resolution
    wrong = unexpected(verdicts)
    if tally is not None:
        for target, check, verdict in verdicts:
            key = f"{target}:{check}:{verdict}"
            tally[key] = tally.get(key, 0) + 1
    if done.returncode != 0 or wrong:
        return f"exit={done.returncode} wall_s={wall:.1f} {'; '.join(wrong)}"
    return Run(wall, report["duration_s"], max(0.0, startup), report["requests_sent"], verdicts)


def unexpected(verdicts: tuple[tuple[str, str, str], ...]) -> list[str]:
    out = []
    for target, check, verdict in verdicts:
        want = "fail" if target == "lab" and check in LAB_FAILS else "pass"
        if verdict != want:
            out.append(f"{target} {check} was {verdict}, the demo expects {want}")
    return out


def baseline_tree(ref: str, tmp: Path) -> Path:
    path = tmp / "baseline"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), ref], check=True
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="git revision to compare with")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="time this tree only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfence-bench-mainjob-") as tmp:
        trees = {"new": ROOT / "src"}
        base: Path | None = None
        if not args.no_baseline:
            base = baseline_tree(args.baseline, Path(tmp))
            trees = {"baseline": base / "src", **trees}
        try:
            runs = measure(trees, args.repeats)
        finally:
            if base is not None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                    check=False,
                )
    summarize(runs)


def measure(trees: dict[str, Path], repeats: int) -> dict[str, list[Run]]:
    """Runs that came out as expected, per tree; the others are printed and counted apart.
    Prints, per tree, how often each (target, check) came out with each verdict."""
    runs: dict[str, list[Run]] = {name: [] for name in trees}
    tallies: dict[str, dict[str, int]] = {name: {} for name in trees}
    for i in range(repeats):
        for name, src in trees.items():
            run = run_main_job(src, tallies[name])
            if isinstance(run, str):
                print(f"run tree={name} i={i} NOT AS EXPECTED {run} load1={load1()}", flush=True)
                continue
            runs[name].append(run)
            print(
                f"run tree={name} i={i} wall_s={run.wall_s:.2f} runbook_s={run.runbook_s:.2f} "
                f"startup_s={run.startup_s:.1f} requests={run.requests} exit=0 load1={load1()}",
                flush=True,
            )
    for name, tally in tallies.items():
        shown = " ".join(f"{k}={v}" for k, v in sorted(tally.items()))
        print(f"verdicts tree={name} runs={repeats} {shown} load1={load1()}", flush=True)
    return runs


def summarize(runs: dict[str, list[Run]]) -> None:
    if not all(runs.values()):
        print(f"main_job no comparison: a tree had no run as expected load1={load1()}")
        return
    wall = {n: statistics.median(r.wall_s for r in rs) for n, rs in runs.items()}
    book = {n: statistics.median(r.runbook_s for r in rs) for n, rs in runs.items()}
    line = f"main_job median_wall_s new={wall['new']:.2f}"
    if "baseline" in wall:
        line += f" baseline={wall['baseline']:.2f} ratio={wall['new'] / wall['baseline']:.2f}"
    line += f" goal<={TARGET_S:.0f}s goal_ratio={wall['new'] / TARGET_S:.2f}"
    line += f" runbook new={book['new']:.2f}"
    if "baseline" in book:
        line += f" baseline={book['baseline']:.2f}"
    print(f"{line} repeats={len(runs['new'])} load1={load1()}", flush=True)


if __name__ == "__main__":
    main()
