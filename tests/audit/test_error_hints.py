"""Errors that say what to do, where no engine is needed to show them: a dead target, a
benchmark result without per-request timings, one tenant's key alone."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kvfence.audit.checks.latency.check import latency_command
from kvfence.audit.cli import audit
from kvfence.watch.cli import watch

DEAD = "http://127.0.0.1:9"
# `vllm bench serve --save-result` without --save-detailed: the run-level fields only
# (vllm/benchmarks/serve.py pops input_lens, output_lens, start_times, ttfts, itls,
# generated_texts and errors unless --save-detailed is given).
VLLM_SUMMARY = {
    "date": "20261206-031500",
    "backend": "vllm",
    "model_id": "Qwen/Qwen2-0.5B",
    "tokenizer_id": "Qwen/Qwen2-0.5B",
    "num_prompts": 200,
    "request_rate": "inf",
    "burstiness": 1.0,
    "max_concurrency": None,
    "duration": 41.2,
    "completed": 200,
    "total_input_tokens": 204800,
    "total_output_tokens": 25600,
    "request_throughput": 4.85,
    "mean_ttft_ms": 812.4,
    "median_ttft_ms": 790.1,
    "std_ttft_ms": 120.3,
    "p99_ttft_ms": 1180.0,
    "mean_tpot_ms": 31.2,
    "mean_itl_ms": 30.9,
}


# Keys only from the command line here, never from the environment running the tests.
NO_KEYS_IN_ENV = {"KVFENCE_AUDIT_KEY_A": None, "KVFENCE_AUDIT_KEY_B": None}


def flat(output: str) -> str:
    return " ".join(output.split())  # rich wraps long lines


def test_a_dead_target_is_one_sentence_said_once() -> None:
    res = CliRunner().invoke(audit, ["--target", DEAD])
    assert res.exit_code == 2, res.output
    text = flat(res.output)
    assert text.count(f"nothing answered at {DEAD} (ConnectError") == 1, res.output
    assert "is the engine running, and is this its base URL?" in text
    assert "{" not in text and "'" not in text, res.output  # no Python reprs


def test_a_vllm_result_without_per_request_data_asks_for_save_detailed(tmp_path: Path) -> None:
    log = tmp_path / "vllm-result.json"
    log.write_text(json.dumps(VLLM_SUMMARY) + "\n")
    res = CliRunner().invoke(latency_command, ["--from-log", str(log)])
    assert res.exit_code == 2, res.output
    text = flat(res.output)
    assert "rerun `vllm bench serve --save-result` with --save-detailed" in text, res.output
    assert "skipped: 1 benchmark summary without per-request timings" in text, res.output
    assert "{" not in text, res.output


def test_watch_given_one_tenants_key_says_it_lacks_a_second() -> None:
    res = CliRunner(env=NO_KEYS_IN_ENV).invoke(
        watch, ["--target", DEAD, "--once", "--key-a", "tenant-a-key"]
    )
    assert res.exit_code == 2, res.output
    text = flat(res.output)
    assert "only tenant A's key was given" in text, res.output
    assert "need a second tenant's key: pass --key-b (or set KVFENCE_AUDIT_KEY_B)" in text


def test_audit_given_one_tenants_key_says_it_lacks_a_second() -> None:
    res = CliRunner(env=NO_KEYS_IN_ENV).invoke(audit, ["--target", DEAD, "--key-b", "tenant-b-key"])
    assert res.exit_code == 2, res.output
    assert "pass --key-a (or set KVFENCE_AUDIT_KEY_A)" in flat(res.output), res.output
