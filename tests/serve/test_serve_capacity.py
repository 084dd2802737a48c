"""The capacity gate at start-up (I4), the edge limit, honest failure after admission (I6), lab switches."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner
from serve_helpers import IDLE, Served, serve

from kvfence.cli import main
from kvfence.engine.sizing import CapacityGateError
from kvfence.faults import Fault, FaultSet
from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, build_local
from kvfence.serve.tenants import TenantRegistry

SMALL_PREFILL = PoolSizes(prefill_pages=64, decode_pages=512)  # 1,024 tokens < 4,096 x 1.25


def test_serve_refuses_to_start_when_the_gate_fails(checkpoint: Path) -> None:
    result = CliRunner().invoke(
        main, ["serve", "--model", str(checkpoint), "--kv-pages", "prefill=64,decode=512"]
    )
    assert result.exit_code == 1
    assert "capacity gate FAIL" in result.stderr
    assert "1,024 tokens" in result.stderr and "--allow-undersized-pool" in result.stderr
    assert "serving" not in result.stdout


def test_create_app_runs_the_gate_on_the_live_pools(checkpoint: Path) -> None:
    parts = build_local(LocalSpec(checkpoint, kind="mirror", pools=SMALL_PREFILL))
    with pytest.raises(CapacityGateError) as e:
        create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, TenantRegistry.generate())
    assert e.value.report.pool_tokens == 1024 and e.value.report.context_length == 4096


def test_unknown_lab_fault_is_a_usage_error(checkpoint: Path) -> None:
    result = CliRunner().invoke(
        main, ["serve", "--model", str(checkpoint), "--lab-fault", "no-such-fault"]
    )
    assert result.exit_code == 2
    assert "unknown fault switch" in result.stderr


@pytest.fixture(scope="module")
def undersized(checkpoint: Path) -> Iterator[Served]:
    with serve(checkpoint, pools=SMALL_PREFILL, allow_undersized_pool=True) as s:
        yield s


def test_undersized_pool_mode_enforces_the_edge_before_the_engine(undersized: Served) -> None:
    info = undersized.info()
    assert info["max_req_input_len"] == 1024 and info["max_total_num_tokens"] == 1024
    assert info["undersized_pool"] is True
    assert info["capacity_gate"]["passed"] is False
    assert info["capacity_gate"]["skipped"] is False
    assert info["lab"]["faults"] == []
    before = undersized.metrics()
    prompt = [7] * 900
    with pytest.raises(openai.BadRequestError) as e:
        undersized.client().completions.create(
            model=undersized.model, prompt=prompt, max_tokens=200
        )
    err = e.value.body
    assert err["param"] == "max_tokens" and err["code"] == "pool_capacity_exceeded"  # type: ignore[index]
    assert "1100" in err["message"] and "1024" in err["message"]  # type: ignore[index]
    after = undersized.metrics()
    assert after["kvfence_prompt_tokens_total"] == before["kvfence_prompt_tokens_total"]
    ok = undersized.client().completions.create(
        model=undersized.model, prompt=prompt, max_tokens=100, temperature=0
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 100
    assert undersized.wait_idle() == IDLE


@pytest.fixture(scope="module")
def workers_ai_lab(checkpoint: Path) -> Iterator[Served]:
    """The Workers AI configuration: pool < context, gate and edge limit skipped (lab only)."""
    with serve(checkpoint, pools=SMALL_PREFILL, faults=FaultSet.of(Fault.UNDERSIZED_POOL)) as s:
        yield s


def test_lab_undersized_pool_skips_gate_and_edge_and_says_so(workers_ai_lab: Served) -> None:
    info = workers_ai_lab.info()
    assert info["lab"]["faults"] == ["undersized-pool"]
    assert info["capacity_gate"]["skipped"] is True and info["capacity_gate"]["passed"] is False
    assert info["undersized_pool"] is True
    assert info["max_req_input_len"] == 4096  # the edge admits the full context


@pytest.mark.parametrize("stream", [False, True])
def test_failure_after_admission_is_an_error_never_a_200(
    workers_ai_lab: Served, stream: bool
) -> None:
    # Passes the router (edge = context under the fault); the prefill engine rejects it.
    body = {"model": workers_ai_lab.model, "prompt": [9] * 2000, "max_tokens": 8, "stream": stream}
    r = workers_ai_lab.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "prefill pool holds at most 1024 tokens" in err["message"]  # the original error
    assert workers_ai_lab.wait_idle() == IDLE
    m = workers_ai_lab.metrics()
    assert m["kvfence_rejections_total{reason=context_length_exceeded}"] >= 1


def test_abort_as_success_fault_reports_the_failure_as_length_200(checkpoint: Path) -> None:
    faults = FaultSet.of(Fault.UNDERSIZED_POOL, Fault.ABORT_AS_SUCCESS)
    with serve(checkpoint, pools=SMALL_PREFILL, faults=faults) as lab:
        assert lab.info()["lab"]["faults"] == ["abort-as-success", "undersized-pool"]
        r = lab.client().completions.create(model=lab.model, prompt=[9] * 2000, max_tokens=8)
        # SGLang #33507 re-created: HTTP 200, finish_reason "length", no content.
        assert r.choices[0].finish_reason == "length" and r.choices[0].text == ""
        body = {"model": lab.model, "prompt": [9] * 2000, "max_tokens": 8, "stream": True}
        raw = lab.post("/v1/completions", json=body)
        assert raw.status_code == 200
        chunks = [json.loads(x[6:]) for x in raw.text.split("\n\n") if x.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_no_auth_dev_mode_is_explicit_and_reported(checkpoint: Path) -> None:
    pools = PoolSizes(prefill_pages=512, decode_pages=512)
    with serve(checkpoint, pools=pools, tenants=TenantRegistry.dev()) as dev:
        assert dev.info()["auth"] == "none"
        r = dev.client().completions.create(model=dev.model, prompt="open", max_tokens=2)
        assert r.choices[0].text and "open".startswith(r.choices[0].text)
