"""Each adapter reads the engine's stated version and decides with that version's rules.

A figure whose meaning is known only for the versions whose source was read (vLLM 0.32-0.33,
SGLang 0.4.6-0.5.23, TGI 2.0-3.3) never passes for another version, nor for an option that
changes what it means; known versions keep their verdicts and say which rule decided.
Responses are the fixtures' (fixtures/*/README.md) with the version or option changed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from audit_replay import FIXTURES, ReplayServer, Route

from kvfence.audit.base import Budget, CheckResult, Verdict
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.client import ProbeClient
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.registry import detect
from kvfence.audit.targets.versions import ReadRange, parse_version

VLLM = FIXTURES / "vllm"
SGLANG = FIXTURES / "sglang"
TGI = FIXTURES / "tgi"


@pytest.fixture
def client(replay: ReplayServer) -> Iterator[ProbeClient]:
    c = ProbeClient(replay.url, api_key=None, budget=Budget(max_requests=50))
    yield c
    c.close()


def capacity(url: str, headroom: float = 1.25, context: int | None = None) -> CheckResult:
    ctx = AuditContext(headroom=headroom, context_override=context)
    with ctx.open():
        target = detect(url, ctx.client_for_url(url, "a"))
        return run_check(CapacityCheck(), ctx, target)


# -- vLLM: GET /version -------------------------------------------------------------------------


def vllm(replay: ReplayServer, version: str | None, metrics: str = "0.32.0-single") -> None:
    replay.routes[("GET", "/metrics")] = Route(
        200, (VLLM / f"{metrics}.metrics.txt").read_text(), "text/plain"
    )
    replay.file("/v1/models", "vllm/0.32.0.models.json")
    if version is not None:
        replay.json("/version", {"version": version})


@pytest.mark.parametrize("version", ["0.32.0", "0.33.1.dev4+g1a2b3c", "0.32.0+cpu"])
def test_vllm_read_versions_pass_and_name_the_rule(
    version: str, replay: ReplayServer, client: ProbeClient
) -> None:
    vllm(replay, version)
    facts = detect(replay.url, client).facts(client)
    assert facts.extra["version"].value == version
    assert facts.extra["version"].source == "GET /version version"
    res = capacity(replay.url)
    assert res.verdict is Verdict.PASS, res.summary
    note = res.evidence["pool_tokens"]["note"]
    assert f"vLLM {version} (GET /version version), rules of vLLM 0.32 to 0.33" in note
    assert "kv_cache_size_tokens" in res.evidence["pool_tokens"]["source"]


def test_vllm_as_captured_live_states_its_release(
    replay: ReplayServer, client: ProbeClient
) -> None:
    vllm(replay, None)
    replay.file("/version", "vllm/0.32.0.version.json")
    facts = detect(replay.url, client).facts(client)
    assert facts.extra["version"].value == "0.32.0"
    assert facts.pool_tokens.value == 64 * 128
    assert facts.pool_tokens.note.startswith("vLLM 0.32.0 (GET /version version)")


@pytest.mark.parametrize(("version", "side"), [("0.40.1", "newer"), ("0.20.0", "older")])
def test_vllm_outside_the_versions_read_is_inconclusive_naming_it(
    version: str, side: str, replay: ReplayServer
) -> None:
    vllm(replay, version)
    res = capacity(replay.url)
    # 8,192 >= 2,048 x 1.25 would pass by 0.32's rules; 0.40's labels are not known to mean that
    assert res.verdict is Verdict.INCONCLUSIVE
    assert f"vLLM {version} is {side} than the versions" in res.summary
    assert "8,192" in res.summary


def test_vllm_version_that_names_no_release_decides_by_the_label_set(replay: ReplayServer) -> None:
    vllm(replay, "dev")
    res = capacity(replay.url)
    assert res.verdict is Verdict.PASS
    assert "states version 'dev'" in res.evidence["pool_tokens"]["note"]


def test_vllm_without_group_aware_size_is_never_blocks_times_block_size(
    replay: ReplayServer,
) -> None:
    """No kv_cache_size_tokens: 64 x 128 = 8,192 would pass, but the labels cannot show that
    the model has one uniform KV-cache group (sliding-window hybrids share one block pool)."""
    vllm(replay, "0.32.0")
    text = (VLLM / "0.32.0-single.metrics.txt").read_text()
    text = re.sub(r'kv_cache_size_tokens="\d+",', "", text)
    replay.routes[("GET", "/metrics")] = Route(200, text, "text/plain")
    res = capacity(replay.url)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "one uniform KV-cache group" in res.summary


@pytest.mark.parametrize(("blocks", "verdict"), [(20, Verdict.FAIL), (21, Verdict.PASS)])
def test_vllm_null_block_is_not_pool_a_request_can_use(
    blocks: int, verdict: Verdict, replay: ReplayServer
) -> None:
    """kv_cache_size_tokens counts every block, block 0 included, which vLLM keeps as its null
    block: 20 x 128 = 2,560 states exactly 2,048 x 1.25, yet only 19 blocks hold tokens."""
    vllm(replay, "0.32.0")
    text = (VLLM / "0.32.0-single.metrics.txt").read_text()
    text = text.replace('kv_cache_size_tokens="8192"', f'kv_cache_size_tokens="{blocks * 128}"')
    text = text.replace('num_gpu_blocks="64"', f'num_gpu_blocks="{blocks}"')
    replay.routes[("GET", "/metrics")] = Route(200, text, "text/plain")
    res = capacity(replay.url)
    assert res.verdict is verdict, res.summary
    if verdict is Verdict.FAIL:
        assert "2,432 usable < 2,560, short by 128 tokens" in res.summary
        assert "null block" in res.summary and res.evidence["usable_tokens"] == 2432


def test_vllm_offloading_node_is_unified_not_decode(
    replay: ReplayServer, client: ProbeClient
) -> None:
    """--kv-offloading-size makes a single node a kv_both connector, which exports the
    consumer's kv_fetch gauge: still one whole engine, gated on its own device pool."""
    vllm(replay, "0.32.0", metrics="0.32.0-offload")
    facts = detect(replay.url, client).facts(client)
    assert facts.extra["pd_role"].value == "unified"
    assert "kv_offloading_size=4.0" in facts.extra["pd_role"].source
    assert facts.extra["kv_offloading"].value == "4.0 GiB (native)"
    assert facts.pool_tokens.value == 8192  # the device pool; the offload tier is a cache
    res = capacity(replay.url)
    assert res.verdict is Verdict.PASS, res.summary


def test_vllm_nixl_decode_node_with_an_offload_tier_stays_decode(
    replay: ReplayServer, client: ProbeClient
) -> None:
    """NIXL series beside the offload size: a P/D consumer, whose pool is not the gate's."""
    vllm(replay, "0.32.0")
    text = (VLLM / "0.32.0-nixl-decode.metrics.txt").read_text()
    offload = text.replace('kv_offloading_size="None"', 'kv_offloading_size="4.0"')
    assert offload != text
    replay.routes[("GET", "/metrics")] = Route(200, offload, "text/plain")
    assert detect(replay.url, client).facts(client).extra["pd_role"].value == "decode"
    assert capacity(replay.url).verdict is Verdict.INCONCLUSIVE


# -- SGLang: /server_info version -----------------------------------------------------------


def sglang(replay: ReplayServer, edit: Any = None) -> None:
    info = json.loads((SGLANG / "0.5.23-unified.server_info.json").read_text())
    if edit is not None:
        edit(info)
    replay.json("/server_info", info)
    replay.file("/v1/models", "sglang/0.5.23-unified.models.json")


def _set_version(version: str | None) -> Any:
    def edit(info: dict[str, Any]) -> None:
        if version is None:
            info.pop("version")
        else:
            info["version"] = version

    return edit


@pytest.mark.parametrize("version", ["0.5.23", "0.5.2", "0.4.6"])
def test_sglang_versions_read_or_between_pass_and_name_the_rule(
    version: str, replay: ReplayServer, client: ProbeClient
) -> None:
    sglang(replay, _set_version(version))
    facts = detect(replay.url, client).facts(client)
    assert facts.extra["version"].value == version
    res = capacity(replay.url)
    assert res.verdict is Verdict.PASS, res.summary
    assert f"SGLang {version} (GET /server_info version)" in res.evidence["pool_tokens"]["note"]


@pytest.mark.parametrize(
    ("version", "why"),
    [
        ("0.6.0", "SGLang 0.6.0 is newer than the versions"),
        ("0.3.6", "SGLang 0.3.6 is older than the versions"),
        (None, "SGLang did not state its version"),
    ],
)
def test_sglang_outside_the_versions_read_is_inconclusive(
    version: str | None, why: str, replay: ReplayServer
) -> None:
    sglang(replay, _set_version(version))
    res = capacity(replay.url)
    assert res.verdict is Verdict.INCONCLUSIVE  # 400,000 would pass by 0.5.23's rules
    assert why in res.summary and "400,000" in res.summary


def test_sglang_hybrid_sliding_window_pool_never_passes(replay: ReplayServer) -> None:
    def swa(info: dict[str, Any]) -> None:
        info["internal_states"][0]["memory_usage"]["token_capacity_swa"] = 80000

    sglang(replay, swa)
    res = capacity(replay.url)
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "ranks [0] run a hybrid sliding-window pool" in res.summary


# -- TGI: /info version ---------------------------------------------------------------------


def tgi(replay: ReplayServer, name: str, version: str | None) -> None:
    info = json.loads((TGI / f"{name}.info.json").read_text())
    if version is None:
        info.pop("version")
    else:
        info["version"] = version
    replay.json("/info", info)


@pytest.mark.parametrize(("version", "why"), [(None, "did not state"), ("3.4.0", "newer")])
def test_tgi_start_up_guarantee_needs_a_version_read(
    version: str | None, why: str, replay: ReplayServer
) -> None:
    tgi(replay, "3.3.7", version)
    res = capacity(replay.url, headroom=1.0)
    # 3.3.7's guarantee (8,192 = max_total_tokens) passes at headroom 1.0; an unread version's
    # warm-up is not known to refuse a pool below max_total_tokens
    assert res.verdict is Verdict.INCONCLUSIVE
    assert why in res.summary and "start-up guarantee" in res.summary


def test_tgi_read_version_keeps_its_guarantee_and_names_it(replay: ReplayServer) -> None:
    tgi(replay, "3.3.7", "3.3.7")
    res = capacity(replay.url, headroom=1.0)
    assert res.verdict is Verdict.PASS
    assert "TGI 3.3.7 v3 backend" in res.evidence["pool_tokens"]["source"]


def test_a_start_up_guarantee_below_the_need_is_no_proof_of_a_short_pool(
    replay: ReplayServer,
) -> None:
    """3.3.7 promises a pool of at least max_total_tokens (8,192); its real size is not
    stated, so an operator context of 9,000 is neither covered nor shown to be short."""
    tgi(replay, "3.3.7", "3.3.7")
    res = capacity(replay.url, headroom=1.0, context=9000)
    assert res.verdict is Verdict.INCONCLUSIVE, res.summary
    assert "lower bound" in res.summary and "pool 8,192 < context 9,000" in res.summary
    assert "fixes" not in res.evidence
    assert capacity(replay.url, headroom=1.0, context=8192).verdict is Verdict.PASS


def test_tgi_batch_pool_of_an_older_version_than_read_is_unknown(replay: ReplayServer) -> None:
    tgi(replay, "2.2.0", "1.4.5")
    res = capacity(replay.url)
    assert res.verdict is Verdict.INCONCLUSIVE  # 37,872 >= 2,048 x 1.25 by 2.x's rules
    assert "TGI 1.4.5 is older" in res.summary and "37,872" in res.summary


# -- llama.cpp and kvfence record what they state -------------------------------------------


def test_llamacpp_records_its_build(replay: ReplayServer, client: ProbeClient) -> None:
    replay.file("/props", "llamacpp/11434.0.0-auto.props.json")
    replay.file("/slots", "llamacpp/11434.0.0-auto.slots.json")
    replay.file("/v1/models", "llamacpp/11434.0.0-auto.models.json")
    facts = detect(replay.url, client).facts(client)
    assert facts.extra["version"].value == "b0-unknown"  # the PyPI build states no release
    assert facts.extra["version"].source == "GET /props build_info"


def test_kvfence_records_its_version(replay: ReplayServer, client: ProbeClient) -> None:
    replay.json(
        "/server_info",
        {
            "engine": "kvfence",
            "version": "9.9.9",
            "max_total_num_tokens": 4096,
            "context_length": 1024,
            "max_req_input_len": 1024,
            "page_size": 16,
        },
    )
    facts = detect(replay.url, client).facts(client)
    assert facts.extra["version"].value == "9.9.9"
    assert facts.pool_tokens.value == 4096


# -- the version rules themselves -----------------------------------------------------------


def test_version_strings_parse_to_their_release() -> None:
    assert parse_version("0.32.0+cpu") == (0, 32, 0)
    assert parse_version("v3.3.7") == (3, 3, 7)
    assert parse_version("0.33.1.dev4+g1a2b") == (0, 33, 1)
    assert parse_version("dev") is None and parse_version(None) is None


def test_a_read_range_covers_its_depth_only() -> None:
    minor = ReadRange("vLLM", (0, 32), (0, 33))
    assert minor.covers((0, 33, 9)) and not minor.covers((0, 34, 0))
    patch = ReadRange("SGLang", (0, 4, 6), (0, 5, 23), depth=3)
    assert patch.covers((0, 5, 0)) and not patch.covers((0, 5, 24))
    assert not patch.covers((0, 4, 5))
