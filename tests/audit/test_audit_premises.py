"""Premise facts decide checks: a question that cannot arise is answered, never inconclusive.

Each premise path is read from an engine's real response shape (vLLM's
`enable_prefix_caching`, SGLang's `disable_radix_cache` and
`disaggregation_mode`, llama.cpp's `cache_prompt`, kvfence's `/server_info`),
then shown deciding a check against a live kvfence server. A premise stated
false while the engine does share is still caught: prefix sharing keeps
probing under a stated "no prefix cache" and fails, naming the fact.
"""

from __future__ import annotations

import json
import random
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any

import pytest
from audit_replay import FIXTURES, ReplayServer, Route
from audit_servers import KEY_A, KEY_B, KEY_OP, LARGE, Server, start, stop, wait_ready

from kvfence.audit import premises
from kvfence.audit.base import Budget, CheckResult, Fact, Verdict, worst
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.checks.counters.check import CountersCheck
from kvfence.audit.checks.prefix_sharing.check import PrefixSharingCheck, PrefixSharingConfig
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.report import to_junit
from kvfence.audit.runbook import AuditRun, TargetSummary, run_audit
from kvfence.audit.stats import SequentialDesign
from kvfence.audit.targets.base import TargetFacts
from kvfence.audit.targets.kvfence import KvfenceTarget
from kvfence.audit.targets.llamacpp import LlamacppTarget
from kvfence.audit.targets.sglang import SglangTarget
from kvfence.audit.targets.vllm import VllmTarget

SMALL = PrefixSharingConfig(
    prefix_pages=16, design=SequentialDesign(alpha=1e-3, batch=8, max_per_arm=16)
)


@pytest.fixture
def client(replay: ReplayServer) -> Iterator[ProbeClient]:
    c = ProbeClient(replay.url, api_key=None, budget=Budget(max_requests=60))
    yield c
    c.close()


def _runs(facts: TargetFacts, mode: str = "auto") -> tuple[list[str], dict[str, str]]:
    cache, salt = premises.prefix_cache(facts), premises.salt_support(facts)
    runs, not_run = premises.prefix_runs(mode, cache, salt, random.Random(0))
    return [label for label, _, _ in runs], not_run


# -- each engine's premise facts, from its real response shapes ----------------------


def test_vllm_prefix_caching_off_decides_the_salted_run(
    replay: ReplayServer, client: ProbeClient
) -> None:
    text = (FIXTURES / "vllm" / "0.32.0-single.metrics.txt").read_text()
    off = text.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"')
    assert off != text
    replay.routes[("GET", "/metrics")] = Route(200, off, "text/plain")
    replay.json("/v1/models", json.loads((FIXTURES / "vllm" / "0.32.0.models.json").read_text()))
    facts = VllmTarget(replay.url).facts(client)
    cache = premises.prefix_cache(facts)
    assert cache.absent and "enable_prefix_caching" in cache.fact.source
    runs, not_run = _runs(facts)
    # The unsalted run still tests the claim; only the salted one is decided by it.
    assert runs == ["unsalted"]
    assert "not applicable" in not_run["salted"] and "enable_prefix_caching" in not_run["salted"]
    # The same metrics with caching on: both runs are sent, nothing is decided.
    replay.routes[("GET", "/metrics")] = Route(200, text, "text/plain")
    on = VllmTarget(replay.url).facts(client)
    assert _runs(on) == (["unsalted", "salted"], {})
    # vLLM's metrics never say whether it is split unless NIXL shows: not a premise.
    assert premises.disaggregation(on).fact.value is None


def _sglang(replay: ReplayServer, **changes: Any) -> None:
    sgl = FIXTURES / "sglang"
    info = json.loads((sgl / "0.5.23-unified.server_info.json").read_text())
    for key, value in changes.items():
        if value is None:
            info.pop(key, None)
            for rank in info.get("internal_states", []):
                rank.pop(key, None)
        else:
            info[key] = value
    replay.json("/server_info", info)
    replay.json("/v1/models", json.loads((sgl / "0.5.23-unified.models.json").read_text()))
    metrics = (sgl / "0.5.23-unified.metrics.txt").read_text()
    replay.routes[("GET", "/metrics")] = Route(200, metrics, "text/plain")


def test_sglang_disable_radix_cache_is_the_prefix_premise(
    replay: ReplayServer, client: ProbeClient
) -> None:
    _sglang(replay, disable_radix_cache=True)
    facts = SglangTarget(replay.url).facts(client)
    cache = premises.prefix_cache(facts)
    assert cache.absent and "disable_radix_cache" in cache.fact.source
    assert _runs(facts)[0] == ["unsalted"]


def _counters(target: Any) -> CheckResult:
    ctx = AuditContext()
    check = CountersCheck()
    with ctx.open():
        target.facts(ctx.client(target, "a"))
        check.snapshot(ctx, target)
        return run_check(check, ctx, target)


def test_sglang_unified_node_makes_the_counters_check_not_applicable(
    replay: ReplayServer,
) -> None:
    _sglang(replay)
    res = _counters(SglangTarget(replay.url))
    assert res.verdict is Verdict.NOT_APPLICABLE, res.summary
    assert "disaggregation_mode" in res.summary and "premise" in res.summary
    assert res.evidence["premises"][0]["decides"] is True


def test_sglang_without_a_stated_role_stays_skipped(replay: ReplayServer) -> None:
    # Fail closed: no role stated -> nothing decided; the check is skipped as before, not NA.
    _sglang(replay, disaggregation_mode=None)
    del replay.routes[("GET", "/metrics")]  # its engine_type label would state the role too
    res = _counters(SglangTarget(replay.url))
    assert res.verdict is Verdict.SKIPPED, res.summary
    assert res.evidence["premises"][0]["decides"] is False


def test_llamacpp_cache_prompt_off_is_not_a_premise(
    replay: ReplayServer, client: ProbeClient
) -> None:
    props = json.loads((FIXTURES / "llamacpp/11434.0.0-auto.props.json").read_text())
    props["default_generation_settings"]["params"]["cache_prompt"] = False  # --no-cache-prompt
    replay.json("/props", props)
    replay.json(
        "/v1/models", json.loads((FIXTURES / "llamacpp/11434.0.0-auto.models.json").read_text())
    )
    replay.json("/slots", json.loads((FIXTURES / "llamacpp/11434.0.0-auto.slots.json").read_text()))
    facts = LlamacppTarget(replay.url).facts(client)
    # Each request's own cache_prompt overrides the server default: any tenant turns reuse on.
    assert facts.prefix_caching.value is True
    assert "every request may set cache_prompt" in facts.prefix_caching.note
    runs, not_run = _runs(facts)
    assert runs == ["unsalted"]  # the timing attack is still run against it
    assert "cache_salt support" in not_run["salted"]  # llama-server ignores cache_salt
    assert premises.disaggregation(facts).absent  # one process holds every slot's KV
    assert _counters(LlamacppTarget(replay.url)).verdict is Verdict.NOT_APPLICABLE


def _llamacpp(replay: ReplayServer, slots: int) -> None:
    props = json.loads((FIXTURES / "llamacpp/11434.0.0-auto.props.json").read_text())
    props["total_slots"] = slots
    replay.json("/props", props)
    replay.json(
        "/v1/models", json.loads((FIXTURES / "llamacpp/11434.0.0-auto.models.json").read_text())
    )
    slot_list = json.loads((FIXTURES / "llamacpp/11434.0.0-auto.slots.json").read_text())
    replay.json("/slots", slot_list[:slots])


def _gate(url: str, headroom: float) -> CheckResult:
    ctx = AuditContext(headroom=headroom)
    with ctx.open():
        return run_check(CapacityCheck(), ctx, LlamacppTarget(url))


def test_llamacpp_shared_slot_pool_is_a_bound_the_gate_never_passes_on(
    replay: ReplayServer,
) -> None:
    _llamacpp(replay, slots=4)
    at_one = _gate(replay.url, 1.0)  # n_ctx per slot == context: enough only if not shared
    assert at_one.verdict is Verdict.INCONCLUSIVE, at_one.summary
    assert "only a bound" in at_one.summary and "total_slots" in at_one.summary
    assert _gate(replay.url, 1.25).verdict is Verdict.FAIL  # even the bound is short
    # One slot owns its whole n_ctx: the same numbers are a fact, and the gate can pass.
    _llamacpp(replay, slots=1)
    assert _gate(replay.url, 1.0).verdict is Verdict.PASS


def test_unknown_premises_decide_nothing() -> None:
    facts = TargetFacts(engine=Fact("openai", "test"))
    for p in (
        premises.prefix_cache(facts),
        premises.salt_support(facts),
        premises.disaggregation(facts),
    ):
        assert not p.absent and p.to_json()["holds"] is None
    runs, not_run = _runs(facts)
    assert runs == ["unsalted"] and "not applicable" not in not_run["salted"]


# -- the verdict a deploy pipeline acts on -------------------------------------------


def _run_of(*verdicts: Verdict) -> AuditRun:
    results = [CheckResult(f"c{i}", "t", v, "") for i, v in enumerate(verdicts)]
    return AuditRun([TargetSummary("t", "openai", "test")], results, (), "", 0.0, 0)


def test_not_applicable_passes_a_deploy_gate_but_never_hides_a_fail() -> None:
    na, ok = Verdict.NOT_APPLICABLE, Verdict.PASS
    assert _run_of(na).exit_code() == 0
    assert _run_of(na, ok).exit_code() == 0 and worst([na, ok]) is ok
    assert _run_of(na, Verdict.INCONCLUSIVE).exit_code() == 2
    assert _run_of(na, Verdict.FAIL).exit_code() == 1
    assert _run_of(Verdict.SKIPPED).exit_code() == 2  # nothing decided at all
    case = to_junit(_run_of(na)).find(".//testcase")
    assert case is not None
    assert [c.tag for c in case] == ["system-out"]  # a passing case, named in its output
    assert "not_applicable" in ET.tostring(case, encoding="unicode")


# -- live: a kvfence server without a prefix cache, and one that shares and lies -----


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("premise-servers")
    both = {
        "no_cache": start(tmp, "no-cache", pages=LARGE, extra=("--no-prefix-cache",)),
        "shared": start(tmp, "shared", pages=LARGE, faults=("shared-prefix-cache",)),
    }
    try:
        for s in both.values():
            wait_ready(s)
        yield both
    finally:
        for s in both.values():
            stop(s)


def _ctx() -> AuditContext:
    return AuditContext(key_a=KEY_A, key_b=KEY_B, operator_key=KEY_OP, budget=Budget(1000, 300.0))


@pytest.mark.slow
def test_no_prefix_cache_is_a_decisive_pass_naming_the_fact(servers: dict[str, Server]) -> None:
    with _ctx().open() as ctx:
        run = run_audit(
            [servers["no_cache"].url], ctx, engine="kvfence", checks=("prefix_sharing",)
        )
    (res,) = run.results
    assert res.verdict is Verdict.PASS, res.summary  # was INCONCLUSIVE: "caching may be off"
    assert run.exit_code() == 0
    assert "prefix_cache.enabled = False" in res.summary and "salted: not run" in res.summary
    assert (
        "salted" not in res.evidence
        and res.evidence["unsalted"]["trials"] == PrefixSharingConfig().design.max_per_arm
    )
    print(f"\nno prefix cache: pass in {res.requests_sent} requests")


@pytest.mark.slow
def test_salt_only_run_without_a_cache_is_decided_by_the_premise(
    servers: dict[str, Server],
) -> None:
    cfg = PrefixSharingConfig(
        prefix_pages=16, salt="only", design=SequentialDesign(alpha=1e-3, batch=8, max_per_arm=16)
    )
    with _ctx().open() as ctx:
        res = run_check(PrefixSharingCheck(cfg), ctx, KvfenceTarget(servers["no_cache"].url))
    control = res.evidence["salted"]["same_salt_control"]
    assert control["hit_by_cached_tokens"] is False  # no cache: the control cannot hit
    assert res.verdict is Verdict.PASS, res.summary
    assert "no prefix cache" in res.summary and "as stated" in res.summary


class ClaimsNoPrefixCache(KvfenceTarget):
    """A kvfence server whose facts say "prefix cache off" while it shares one across tenants
    (the real lab server answers every request; only the stated fact is false)."""

    def read_facts(self, client: ProbeClient) -> TargetFacts:
        facts = super().read_facts(client)
        assert facts.prefix_caching.value is True  # what the server really states
        facts.prefix_caching = Fact(False, "GET /server_info prefix_cache.enabled (rewritten)")
        return facts


@pytest.mark.slow
def test_a_false_no_cache_claim_is_still_caught(servers: dict[str, Server]) -> None:
    with _ctx().open() as ctx:
        res = run_check(PrefixSharingCheck(SMALL), ctx, ClaimsNoPrefixCache(servers["shared"].url))
    assert res.verdict is Verdict.FAIL, res.summary
    assert re.search(r"states it has no prefix cache \(GET /server_info", res.summary)
    assert res.evidence["premise_contradicted"]["premise"] == "prefix cache"
    assert res.evidence["unsalted"]["cross_tenant_cached_hits"] >= 1
