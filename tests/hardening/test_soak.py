"""The 32-tenant soak (bench/soak.py) in CI: 60 s of mixed traffic on the disaggregated engine.

Asserts 0 sentinel crossings, the client's counts per outcome equal to the
server's counters, no page in use once quiet and every worker's ledger
integrity ok; prints requests served, TTFT p50/p99 and throughput against a
single-tenant run of the same length. The broken build (the incident's
switches, no-ledger-check among them) must show crossings in the same soak.
`python bench/soak.py --seconds N` runs it longer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from bench.soak import soak  # noqa: E402

from kvfence.lab.profiles import INCIDENT_FAULTS  # noqa: E402

SECONDS = float(os.environ.get("KVFENCE_SOAK_SECONDS", "60"))


def test_32_tenants_for_a_minute_no_crossing_every_request_accounted(
    hardening_checkpoint: Path,
) -> None:
    r = soak(hardening_checkpoint, seconds=SECONDS, tenants=32)
    print(
        f"soak: {r.requests} requests, {r.served} served, {len(r.crossings)} crossings, "
        f"kinds {dict(r.kinds)}, TTFT p50 {r.p50_ms:.0f} ms p99 {r.p99_ms:.0f} ms, "
        f"{r.throughput:.1f} req/s vs single tenant {r.single_throughput:.1f} req/s, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    assert r.requests > 32 and all(r.kinds[k] > 0 for k in ("over-long", "cut-stream"))
    assert r.problems == [], r.problems
    assert r.server["finished"] == r.served and r.client["rejected"] > 0


def test_the_soak_finds_crossings_with_the_ledger_check_off(hardening_checkpoint: Path) -> None:
    """The incident's switches (undersized pool, live reject path, decode trusting the
    bootstrap, no-ledger-check): near-limit prompts read other tenants' pages."""
    r = soak(
        hardening_checkpoint,
        seconds=10,
        tenants=32,
        faults=[f.value for f in INCIDENT_FAULTS],
        kv_pages="prefill=21,decode=256",
        baseline=False,
    )
    assert r.crossings, f"no crossing found with the defences off: {r}"


def test_kill_9_a_prefill_and_a_decode_worker_under_the_soak(hardening_checkpoint: Path) -> None:
    """Two workers per role; prefill-0 and then decode-0 are killed -9 and restarted.

    Requests on the dead worker end with an error (a 503, or an SSE error event), never a
    200 without the whole answer; the others complete; each restarted worker rejoins and
    carries requests; once quiet no page is in use and every worker's ledger is ok; the
    client's counts per outcome still equal the server's.
    """
    r = soak(
        hardening_checkpoint,
        seconds=30,
        tenants=32,
        baseline=False,
        crashes=[(6.0, "prefill-0"), (16.0, "decode-0")],
    )
    print(
        f"crash soak: {r.requests} requests, outcomes {dict(r.client)}, rejoined {r.rejoined}, "
        f"integrity {r.integrity}"
    )
    assert r.problems == [], r.problems
    assert r.client["failed"] > 0, "no request was in flight on a killed worker"
    assert r.served > 0 and len(r.integrity) == 4
