"""The statistical checks against a real `kvfence serve` process on loopback.

Hardened server: prefix sharing, noninterference and prefill latency pass.
`--lab-fault shared-prefix-cache`: prefix sharing fails — by cached_tokens
at once, and by timing alone through the sequential KS test.
The Workers AI fault combination: prompts past the pool are answered from a
1-token placeholder, so the prefill-latency check fails on them, and the
noninterference check refuses to vouch for the long probe.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.latency.check import LatencyCheck, LatencyConfig
from kvfence.audit.checks.noninterference.check import NoninterferenceCheck, NoninterferenceConfig
from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.stats import SequentialDesign
from kvfence.audit.targets.kvfence import KvfenceTarget

pytestmark = pytest.mark.slow

KEY_A = "audit-stats-key-a-5f1c2e"
KEY_B = "audit-stats-key-b-9d7a41"
KEY_OP = "audit-stats-operator-3b8e07"
URL_LINE = re.compile(r"kvfence serving \S+ at (http://\S+)")


@dataclass(frozen=True)
class Server:
    url: str
    faults: tuple[str, ...]


def _start(tmp: Path, faults: tuple[str, ...], extra: tuple[str, ...] = ()) -> Iterator[Server]:
    tenants = tmp / "tenants.json"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {"name": "tenant-a", "keys": [KEY_A]},
                    {"name": "tenant-b", "keys": [KEY_B]},
                ],
                "operator_keys": [KEY_OP],
            }
        ),
        encoding="utf-8",
    )
    kvfence = Path(sys.executable).parent / "kvfence"  # the installed console script
    cmd = [str(kvfence), "serve", "--tenants", str(tenants), *extra]
    for f in faults:
        cmd += ["--lab-fault", f]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp
    )
    try:
        url = None
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = URL_LINE.search(line)
            if m:
                url = m.group(1)
        assert url is not None, f"kvfence serve did not announce a URL (exit {proc.poll()})"
        yield Server(url, faults)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def hardened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("hardened"), ())


@pytest.fixture(scope="module")
def leaky(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("leaky"), ("shared-prefix-cache",))


# The Workers AI combination at a scale where prefill cost is measurable: context
# 4,096 over a prefill pool of 2,688 tokens (the incident's 0.656 ratio).
INCIDENT_FAULTS = (
    "undersized-pool",
    "abort-not-terminal",
    "decode-trusts-bootstrap",
    "no-ledger-check",
)
INCIDENT_ARGS = (
    "--context-length",
    "4096",
    "--page-size",
    "16",
    "--kv-pages",
    "prefill=168,decode=512",
)


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _start(tmp_path_factory.mktemp("incident"), INCIDENT_FAULTS, INCIDENT_ARGS)


def _run(server: Server, check: object, seed: int = 0) -> CheckResult:
    ctx = AuditContext(
        key_a=KEY_A,
        key_b=KEY_B,
        operator_key=KEY_OP,
        seed=seed,
        budget=Budget(max_requests=2000, max_seconds=300),
    )
    with ctx.open():
        target = KvfenceTarget(server.url)
        return run_check(check, ctx, target)  # type: ignore[arg-type]


SMALL_PREFIX = PrefixSharingConfig(
    prefix_pages=16,
    min_prefix_tokens=256,
    design=SequentialDesign(alpha=1e-3, batch=8, max_per_arm=24),
    salt_control_trials=4,
)


def test_prefix_sharing_passes_on_the_hardened_server(hardened: Server) -> None:
    res = _run(hardened, PrefixSharingCheck(SMALL_PREFIX))
    assert res.verdict is Verdict.PASS, res.summary
    unsalted, salted = res.evidence["unsalted"], res.evidence["salted"]
    # kvfence reports cached_tokens, and B never saw any of A's.
    assert unsalted["cached_tokens_reported"] is True
    assert unsalted["cross_tenant_cached_hits"] == 0
    assert unsalted["trials"] == 24 and not unsalted["ks"]["rejected"]
    # Salted: different salts miss AND the same salt hits (the control is not vacuous).
    assert salted["verdict"] == "pass"
    assert salted["same_salt_control"]["hit_by_cached_tokens"] is True
    print(f"\nhardened prefix-sharing: pass after {res.evidence['requests']} requests")


def test_prefix_sharing_fails_on_shared_prefix_cache_by_cached_tokens(leaky: Server) -> None:
    cfg = PrefixSharingConfig(
        prefix_pages=16,
        min_prefix_tokens=256,
        design=SequentialDesign(alpha=1e-3, batch=8, max_per_arm=24),
        salt="off",
    )
    res = _run(leaky, PrefixSharingCheck(cfg))
    assert res.verdict is Verdict.FAIL, res.summary
    ev = res.evidence["unsalted"]
    assert ev["cross_tenant_cached_hits"] >= 1
    hit = ev["cross_tenant_hit_examples"][0]
    assert hit["cached_tokens"] >= 256
    # Stopped at the first hit: one trial (A's warm-up, B's two probes) is proof.
    assert res.evidence["requests"] == 3
    print(f"\nshared-prefix-cache (cached_tokens): fail after {res.evidence['requests']} requests")


def test_prefix_sharing_fails_on_shared_prefix_cache_by_timing_alone(leaky: Server) -> None:
    cfg = PrefixSharingConfig(
        prefix_pages=64,
        min_prefix_tokens=1024,
        design=SequentialDesign(alpha=1e-3, batch=8, max_per_arm=48),
        salt="off",
        stop_on_cached_evidence=False,
    )
    res = _run(leaky, PrefixSharingCheck(cfg), seed=1)
    assert res.verdict is Verdict.FAIL, res.summary
    ks = res.evidence["unsalted"]["ks"]
    assert ks["rejected"] and ks["p_value"] < ks["threshold_per_look"]
    assert res.evidence["requests"] < 250 + 250
    print(
        f"\nshared-prefix-cache (timing only): fail, KS p = {ks['p_value']:.2e} after "
        f"{res.evidence['requests']} requests"
    )


def test_salted_prefix_sharing_fails_when_the_lab_collapses_namespaces(leaky: Server) -> None:
    cfg = PrefixSharingConfig(
        prefix_pages=16,
        min_prefix_tokens=256,
        design=SequentialDesign(alpha=1e-3, batch=8, max_per_arm=24),
        salt="only",
    )
    res = _run(leaky, PrefixSharingCheck(cfg), seed=2)
    assert res.verdict is Verdict.FAIL, res.summary
    assert "unsalted" not in res.evidence
    assert res.evidence["salted"]["cross_tenant_cached_hits"] >= 1


def test_noninterference_passes_on_the_hardened_server(hardened: Server) -> None:
    res = _run(hardened, NoninterferenceCheck(NoninterferenceConfig(repeats=5)))
    assert res.verdict is Verdict.PASS, res.summary
    assert res.evidence["load"]["ok"] > 0
    # Repeats grow from 5 until a probe that always diverges under load could reach the
    # check's share of alpha (5 could not: a pass there could not have been a fail).
    assert res.evidence["repeats"] > 5
    # Every probe in every round sent; the rounds may stop before `repeats` once no FAIL
    # is reachable (`noninterference.curtail`).
    under_load = res.evidence["under_load"]
    assert under_load["answers"] == 4 * under_load["rounds"] <= 4 * res.evidence["repeats"]
    assert res.evidence["fisher_p_value"] >= 1e-3


def test_prefill_latency_does_not_fail_on_the_hardened_server(hardened: Server) -> None:
    cfg = LatencyConfig(points=5, min_tokens=16, max_tokens_cap=2048)
    res = _run(hardened, LatencyCheck(cfg))
    # Honest prefill is never "too fast"; on a busy 2-core machine the noise may
    # hide the slope (inconclusive), but a fail would be a false alarm.
    assert res.verdict in (Verdict.PASS, Verdict.INCONCLUSIVE), res.summary
    assert res.verdict is not Verdict.FAIL
    assert res.evidence["samples"] == sum(res.evidence["sweep"]["repeats_per_length"].values())
    assert res.alpha == pytest.approx(1e-3 / 3) and res.p_value is not None
    assert res.plots and res.plots[0].kind == "xy"


def test_prefill_latency_fails_on_the_incident_reject_path(incident: Server) -> None:
    # The reject path here costs something of its own (4,095 tokens are still read and
    # checked); the sweep's neighbour at half the limit (2,047 tokens, inside the pool)
    # pays enough honest prefill that the exact test still tells them apart.
    cfg = LatencyConfig(points=5, min_tokens=16)
    res = _run(incident, LatencyCheck(cfg))
    assert res.verdict is Verdict.FAIL, res.summary
    assert res.p_value is not None and res.alpha is not None and res.p_value < res.alpha
    ev = res.evidence
    assert ev["sweep"]["lengths"][-1] == 4095  # the longest accepted prompt, past the pool
    assert ev["long_bucket"]["p5_s"] < ev["alarm_threshold_s"]
    assert ev["flagged_count"] >= 1
    assert all(f["prompt_tokens"] > 2688 for f in ev["flagged"])
    flags = res.plots[0].series[0].flags
    assert any(flags)


def test_audit_alpha_sizes_the_sweep_and_is_reported(incident: Server, tmp_path: Path) -> None:
    """`kvfence audit --alpha 1e-6 --checks latency`: the one statistical check gets the whole
    alpha, its sweep grows until a total skip can reach it, and the JSON says so."""
    from click.testing import CliRunner

    from kvfence.audit.cli import audit

    out = tmp_path / "audit.json"
    args = ["--target", incident.url, "--key-a", KEY_A, "--key-b", KEY_B]
    args += ["--operator-key", KEY_OP, "--checks", "latency", "--alpha", "1e-6"]
    args += ["--quiet", "--json", str(out)]
    r = CliRunner().invoke(audit, args)
    assert r.exit_code == 1, r.output
    report = json.loads(out.read_text())
    (res,) = report["results"]
    assert res["verdict"] == "fail" and res["alpha"] == 1e-6 and res["p_value"] < 1e-6
    # Each of the check's up to `sweeps` sweeps is tested at alpha / sweeps (Bonferroni).
    per_sweep = 1e-6 / LatencyConfig().sweeps
    assert res["evidence"]["sweep"]["repeats"] == LatencyConfig().sweep_repeats(per_sweep) > 8
    assert report["settings"]["alpha"] == 1e-6
    # Every probe of the sweep was sent: the lengths only the cost fit reads take fewer repeats.
    assert res["requests_sent"] >= sum(res["evidence"]["sweep"]["repeats_per_length"].values())
    print(
        f"\n--alpha 1e-6: latency fail at p = {res['p_value']:.2g}, {res['requests_sent']} requests"
    )


def test_noninterference_does_not_pass_on_the_incident(incident: Server) -> None:
    res = _run(incident, NoninterferenceCheck(NoninterferenceConfig(repeats=8)))
    assert res.verdict is not Verdict.PASS, res.summary
    # The long probe sits one page past the 2,688-token pool, on the reject path,
    # and it is what shows the problem: it changes under A's load (fail) or is
    # unstable even alone (inconclusive); the short probes stay stable.
    assert res.evidence["probe_tokens"][-1] == 2688 + 16
    long_probe = len(res.evidence["probe_tokens"]) - 1
    if res.verdict is Verdict.FAIL:
        p_long = res.evidence["fisher_p_value_per_probe"][str(long_probe)]
        assert p_long < res.evidence["alpha_per_test"]
    else:
        assert res.evidence["unstable_alone"] == [long_probe]
    print(f"\nincident noninterference: {res.verdict.value}: {res.summary}")
