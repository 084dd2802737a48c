"""`kvfence watch --once` prints the false-alarm budget it runs under (issue 11, item 5)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from watch_helpers import hardened

from kvfence.cli import main
from kvfence.lab.scenario import OPERATOR, TENANT_A, TENANT_B


def test_watch_once_prints_the_budget_and_the_alpha_it_derives(checkpoint: Path) -> None:
    with hardened(checkpoint) as (url, keys):
        args = ["watch", "--once", "--target", url, "--key-a", keys[TENANT_A]]
        args += ["--key-b", keys[TENANT_B], "--operator-key", keys[OPERATOR], "--no-timing"]
        default = CliRunner().invoke(main, args)
        chosen = CliRunner().invoke(
            main, [*args, "--false-alarms-per-30d", "3", "--interval", "10"]
        )
    assert default.exit_code == 0, default.output
    # 30 days at 60 s: 43,200 tests; 1 / 43,200 = 2.3e-05 per test.
    assert (
        "false-alarm budget 1 per target per 30 days: 43200 timing tests at 60 s -> "
        "alpha 2.3e-05 per test (union bound)" in default.output
    ), default.output
    assert chosen.exit_code == 0, chosen.output
    # 259,200 tests at 10 s; 3 / 259,200 = 1.2e-05.
    assert (
        "false-alarm budget 3 per target per 30 days: 259200 timing tests at 10 s -> "
        "alpha 1.2e-05 per test" in chosen.output
    ), chosen.output
    assert f"{url}: pass: facts known" in default.output


def test_a_failing_probe_never_hides_the_facts_and_a_failed_gate_runs_again(
    checkpoint: Path,
) -> None:
    """On real kvfence: a probe that raises after the facts were read is counted (alerted on
    by GuardProbesFailing) and grades the interval inconclusive, while the facts stay known —
    KVPoolBelowContext needs facts_known == 1, so an 'unknown' here hid a gate alarm. A gate
    re-run that raised is run again next interval (the fingerprint alone did not retry it)."""
    from kvfence.audit.base import Verdict
    from kvfence.watch.cli import verdict_of
    from kvfence.watch.guard import GuardConfig, Keys, TargetGuard
    from kvfence.watch.metrics import WatchMetrics

    class Flaky(TargetGuard):
        fail_gate, fail_probe = 1, 1

        def _gate(self, target):  # type: ignore[no-untyped-def]
            if self.fail_gate:
                self.fail_gate -= 1
                raise RuntimeError("gate broke")
            return super()._gate(target)

        def _probe(self, target, facts, out):  # type: ignore[no-untyped-def]
            if self.fail_probe and not self.fail_gate:
                self.fail_probe -= 1
                raise RuntimeError("probe broke")
            super()._probe(target, facts, out)

    config = GuardConfig(interval_s=1.0, timing=False, max_target_share=1.0)
    with hardened(checkpoint) as (url, keys):
        guard = Flaky(url, "kvfence", Keys(keys[TENANT_A], keys[TENANT_B], keys[OPERATOR]),
                      config, WatchMetrics())  # fmt: skip
        try:
            outs = [guard.cycle() for _ in range(3)]
        finally:
            guard.close()

    def metric(name: str) -> float | None:
        return guard.metrics.registry.get_sample_value(name, {"target": url})

    gate_broke, probe_broke, ok = outs
    assert gate_broke.facts_known and "gate broke" in gate_broke.error
    assert probe_broke.facts_known and "probe broke" in probe_broke.error
    assert probe_broke.gate is not None  # the gate that raised ran again
    assert [verdict_of(o) for o in outs] == [Verdict.INCONCLUSIVE] * 2 + [Verdict.PASS]
    assert ok.gate is None and not ok.error  # gated once, nothing changed since
    assert metric("kvfence_guard_facts_known") == 1
    assert metric("kvfence_guard_probe_errors_total") == 2
    assert metric("kvfence_guard_gate_ok") == 1
