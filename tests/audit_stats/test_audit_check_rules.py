"""The pure decision rules of the prefix-sharing and noninterference checks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvfence.audit.base import Fact, Verdict
from kvfence.audit.checks.noninterference.check import NoninterferenceConfig, probe_lengths
from kvfence.audit.checks.prefix_sharing.check import (
    Arms,
    PrefixSharingConfig,
    judge,
    prefix_length,
)
from kvfence.audit.stats import SequentialDesign, run_sequential
from kvfence.audit.targets.base import TargetFacts


def _facts(limit: int | None, page: int | None, pool: int | None = None) -> TargetFacts:
    f = TargetFacts(engine=Fact("test", "test"))
    f.max_input = Fact(limit, "test") if limit is not None else Fact.unknown("test")
    f.page_size = Fact(page, "test") if page is not None else Fact.unknown("test")
    f.pool_tokens = Fact(pool, "test") if pool is not None else Fact.unknown("test")
    return f


def test_prefix_is_whole_pages_and_fits_the_limit() -> None:
    cfg = PrefixSharingConfig(prefix_pages=8, min_prefix_tokens=512)
    # vLLM CPU: 128-token blocks -> 8 blocks = 1,024 tokens.
    assert prefix_length(cfg, _facts(2047, 128), None)[0] == 1024
    # Small pages: the minimum length wins, rounded to whole pages.
    assert prefix_length(cfg, _facts(4095, 16), None)[0] == 512
    assert prefix_length(cfg, _facts(4095, 48), None)[0] == 528
    # A short limit caps the prefix, still in whole pages, leaving room for the suffix.
    n, _ = prefix_length(cfg, _facts(300, 16), None)
    assert n == 288 and n + cfg.suffix_tokens <= 300
    # Unknown page size: the default page; unknown limit: no prefix (inconclusive).
    assert prefix_length(cfg, _facts(4095, None), None)[0] == 512
    assert prefix_length(cfg, _facts(None, 16), None)[0] is None
    assert prefix_length(cfg, _facts(None, 16), 1000)[0] == 512
    assert prefix_length(cfg, _facts(10, 16), None)[0] is None


def test_a_stricter_level_asks_for_a_longer_prefix_within_the_limit() -> None:
    """At --alpha 1e-9 the shared prefix grows with the evidence asked for (alpha.py):
    real vLLM's 1,024-token prefix left one audit in three inconclusive on a loaded machine."""
    from kvfence.audit.alpha import REFERENCE_SHARE, evidence_scale, sequential_design_for

    cfg = PrefixSharingConfig()  # the check's defaults: 16 pages, at least 256 tokens
    base = cfg.design
    default = sequential_design_for(base, REFERENCE_SHARE)
    assert evidence_scale(default, base) == 1.0  # the default audit's prompts are unchanged
    assert evidence_scale(sequential_design_for(base, 1e-3 / 3), base) == 1.0  # never shorter
    strict = sequential_design_for(base, 5e-10)  # --alpha 1e-9, unsalted + salted runs
    scale = evidence_scale(strict, base)
    assert 2.3 < scale < 2.5
    assert evidence_scale(sequential_design_for(base, 1e-12), base) > 3  # monotone
    # vLLM CPU (128-token blocks, max_model_len 4096): 16 blocks; 32 wanted at 1e-9, 31 fit.
    assert prefix_length(cfg, _facts(4095, 128), None, 1.0)[0] == 2048
    n, how = prefix_length(cfg, _facts(4095, 128), None, scale)
    assert n == 31 * 128 and "2 x the default" in how
    # Always within the longest accepted prompt, in whole pages, with room for the suffix.
    assert prefix_length(cfg, _facts(2047, 128), None, scale)[0] == 1920
    assert prefix_length(cfg, _facts(511, 16), None, scale)[0] == 496
    # Small pages: the minimum length grows by the same whole multiple; 3 x at 1e-12.
    assert prefix_length(cfg, _facts(4095, 16), None, scale)[0] == 512
    assert prefix_length(cfg, _facts(4095, 16), None, 3.05)[0] == 768
    # A level a little below the default's (more runs share it) keeps the default's prompts.
    assert prefix_length(cfg, _facts(4095, 16), None, 1.1)[0] == 256
    assert prefix_length(cfg, _facts(8191, 128), None, 1.9)[0] == 2048


def _arms(shared: list[float], fresh: list[float]) -> Arms:
    return Arms(shared=shared, fresh=fresh, requests=3 * len(shared))


def test_judge_fails_on_cached_tokens_even_without_timing() -> None:
    arms = _arms([0.1], [0.1])
    arms.cross_hits.append({"cached_tokens": 512, "fresh_max_cached_tokens": 0})
    verdict, summary, _ = judge(arms, None, PrefixSharingConfig())
    assert verdict is Verdict.FAIL and "512 cached tokens" in summary


def test_judge_uses_the_sequential_ks_result() -> None:
    design = SequentialDesign(alpha=1e-3, batch=8, max_per_arm=32)
    rng = np.random.default_rng(0)
    shared, fresh = [], []

    def leaky(k: int) -> tuple[list[float], list[float]]:
        x, y = list(rng.normal(0.01, 0.001, k)), list(rng.normal(0.03, 0.001, k))
        shared.extend(x)
        fresh.extend(y)
        return x, y

    seq = run_sequential(leaky, design)
    verdict, summary, ev = judge(_arms(shared, fresh), seq, PrefixSharingConfig(design=design))
    assert verdict is Verdict.FAIL and "by timing" in summary
    assert ev["ks"]["rejected"] is True

    shared2, fresh2 = [], []

    def sound(k: int) -> tuple[list[float], list[float]]:
        x, y = list(rng.normal(0.03, 0.001, k)), list(rng.normal(0.03, 0.001, k))
        shared2.extend(x)
        fresh2.extend(y)
        return x, y

    seq2 = run_sequential(sound, design)
    verdict, summary, ev = judge(_arms(shared2, fresh2), seq2, PrefixSharingConfig(design=design))
    assert verdict is Verdict.PASS and "would have been detected" in summary
    assert 0 < ev["ks"]["detectable_ks_distance"] < 1


def test_judge_is_inconclusive_when_trials_failed() -> None:
    arms = _arms([], [])
    arms.errors.append({"role": "B probe", "status": 400, "error": None})
    verdict, _, _ = judge(arms, None, PrefixSharingConfig())
    assert verdict is Verdict.INCONCLUSIVE


def test_prefix_config_validation() -> None:
    with pytest.raises(ValueError):
        PrefixSharingConfig(salt="sometimes")
    with pytest.raises(ValueError):
        PrefixSharingConfig(token_range=(5, 5))


def test_noninterference_long_probe_targets_the_pool_edge() -> None:
    cfg = NoninterferenceConfig(probes=4, probe_tokens=48, max_tokens=8, long_probe_cap=2048)
    # Pool smaller than the limit: one page past the pool, uncapped (the reject path).
    lengths, why = probe_lengths(cfg, _facts(4095, 16, pool=2688), None)
    assert lengths == [48, 48, 48, 2704] and "past the KV pool" in why
    # Pool large enough: at the input limit, capped.
    assert probe_lengths(cfg, _facts(4095, 16, pool=65536), None)[0][-1] == 2048
    assert probe_lengths(cfg, _facts(1000, 16, pool=65536), None)[0][-1] == 992
    # Unknown limit or no long probe wanted: short probes only.
    assert probe_lengths(cfg, _facts(None, 16), None)[0] == [48] * 4
    off = NoninterferenceConfig(long_probe=False)
    assert probe_lengths(off, _facts(4095, 16), None)[0] == [off.probe_tokens] * off.probes


def test_runbook_loads_the_statistical_checks_by_name() -> None:
    from kvfence.audit.check_table import load_check
    from kvfence.audit.checks.latency.check import LatencyCheck
    from kvfence.audit.checks.noninterference.check import NoninterferenceCheck
    from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck

    assert isinstance(load_check("prefix_sharing"), PrefixSharingCheck)
    assert isinstance(load_check("noninterference"), NoninterferenceCheck)
    assert isinstance(load_check("latency"), LatencyCheck)


def test_every_check_in_the_table_is_the_class_of_that_name() -> None:
    from kvfence.audit.check_table import CHECKS, check_class

    for name, _ in CHECKS:
        cls = check_class(name)
        assert cls.name == name and not getattr(cls, "__abstractmethods__", None), name
    with pytest.raises(ValueError, match="choose from capacity, boundary"):
        check_class("capacty")


def test_a_check_that_cannot_load_fails_the_audit_instead_of_skipping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A missing dependency used to turn a check into SKIPPED with exit code 0 (fail open)."""
    import sys

    from kvfence.audit import check_table, runbook
    from kvfence.audit.base import CheckResult

    # scipy "not installed": the latency check and the statistics it builds on import afresh
    # (monkeypatch puts every module back afterwards).
    for name in [m for m in sys.modules if m == "scipy" or m.startswith("scipy.")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [m for m in sys.modules if m.startswith("kvfence.audit.checks.latency.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "kvfence.audit.stats")
    with pytest.raises(check_table.CheckUnavailable, match="scipy"):
        check_table.load_check("latency")
    lost = runbook.loaded_or_inconclusive("latency", "http://target")
    assert isinstance(lost, CheckResult) and lost.verdict is Verdict.INCONCLUSIVE
    assert "scipy" in lost.summary
    assert not isinstance(runbook.loaded_or_inconclusive("canary", "http://target"), CheckResult)
    passed = CheckResult("canary", "http://target", Verdict.PASS, "no sentinel leaked")
    run = runbook.AuditRun([], [passed, lost], ("canary", "latency"), "now", 0.0, 0)
    assert run.exit_code() == 2  # the deploy is blocked, not waved through


def test_alpha_is_split_over_the_statistical_checks_of_the_run() -> None:
    from kvfence.audit.contract import AuditContext

    ctx = AuditContext(alpha=1e-3)
    assert ctx.alpha_for("latency") == pytest.approx(1e-3 / 3)
    ctx.statistical = ("latency",)  # `--checks latency`: the whole alpha
    assert ctx.alpha_for("latency") == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        AuditContext(alpha=0.0)


def test_designs_grow_until_their_most_extreme_outcome_reaches_alpha() -> None:
    import math

    from kvfence.audit.alpha import fisher_repeats_for, sequential_design_for
    from kvfence.audit.checks.latency.check import LatencyConfig, design_p_value

    for alpha in (1e-3, 1e-6, 1e-9, 1e-12):
        r = fisher_repeats_for(alpha, 1)
        assert 1 / math.comb(2 * r, r) < alpha <= 1 / math.comb(2 * r - 2, r - 1)
        d = sequential_design_for(SequentialDesign(batch=8, max_per_arm=24), alpha)
        n = d.max_per_arm
        assert d.alpha == alpha and 1 / math.comb(2 * n, n) < d.alpha_per_look
        rep = LatencyConfig().repeats_for(alpha)
        assert 2 * design_p_value(rep, rep, 4) < alpha <= 2 * design_p_value(rep - 1, rep - 1, 4)
    assert fisher_repeats_for(1e-3, 8) == 8  # never below the configured repeats
    for alpha in (6.7e-5, 1e-9):  # one miss tolerated: r - 1 of r vs 0 of r reaches alpha
        r = fisher_repeats_for(alpha, 1, misses=1)
        assert math.comb(r, r - 1) / math.comb(2 * r, r - 1) < alpha
        assert math.comb(r - 1, r - 2) / math.comb(2 * r - 2, r - 2) >= alpha
    assert fisher_repeats_for(6.7e-5, 8) == 9 and fisher_repeats_for(6.7e-5, 8, misses=1) == 10
    assert LatencyConfig().repeats_for(1e-9 / 3) > LatencyConfig().repeats_for(1e-3 / 3)


def test_a_smaller_alpha_keeps_the_default_audits_power() -> None:
    """At 1e-9 the default 24 trials per arm reach the level only by complete separation (a
    real, noisy leak passed): the design grows until it detects what the default detects."""
    from kvfence.audit.alpha import REFERENCE_SHARE, sequential_design_for
    from kvfence.audit.stats import ks_critical_distance

    base = SequentialDesign(batch=8, max_per_arm=24)

    def detectable(d: SequentialDesign) -> float:
        return ks_critical_distance(d.max_per_arm, d.max_per_arm, d.alpha_per_look)

    default = sequential_design_for(base, REFERENCE_SHARE)
    assert default.max_per_arm == 24  # the default audit is unchanged
    assert detectable(replace(base, alpha=5e-10)) > 0.95  # 24 per arm at 1e-9: D ~ 1 only
    for alpha in (1e-4, 1e-6, 5e-10, 1e-12):
        d = sequential_design_for(base, alpha)
        assert (
            detectable(d)
            <= detectable(default)
            < detectable(replace(d, max_per_arm=d.max_per_arm - 8))
        )
    assert sequential_design_for(base, 5e-10).max_per_arm == 64
