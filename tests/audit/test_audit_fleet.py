"""A P/D fleet audited through the real sglang-router 0.3.2 (PD mode) on loopback.

The workers are small SGLang 0.5.23-shaped servers (`sglang_worker.py`); the
router is the real Rust router from PyPI, started as its own process on an
ephemeral port. `kvfence audit --target ROUTER_URL` must find every worker,
gate every prefill node, read counters on decode nodes too, and send its
content probes through the router.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sglang_worker import SglangWorker, WorkerSpec

from kvfence.audit.base import Verdict
from kvfence.audit.checks.capacity.check import CapacityCheck
from kvfence.audit.contract import AuditContext, run_check
from kvfence.audit.targets.registry import detect
from kvfence.cli import main
from kvfence.serve.supervisor import free_port

pytestmark = pytest.mark.slow

CONTEXT = 4096
LARGE = 8192  # >= 4096 × 1.25
SHORT = 3000  # < the context: a full-length prompt cannot fit
PD_FAILURES = "sglang:num_transfer_failed_reqs_total"
BOOTSTRAP_FAILURES = "sglang:num_bootstrap_failed_reqs_total"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local checkpoint: the router loads the workers' tokenizer from model_path."""
    out = tmp_path_factory.mktemp("fleet-model")
    kvfence = Path(sys.executable).with_name("kvfence")
    subprocess.run([str(kvfence), "make-model", str(out)], check=True, capture_output=True)
    return str(out)


@contextmanager
def fleet(specs: list[WorkerSpec], log: Path) -> Iterator[tuple[str, list[SglangWorker]]]:
    """The workers, and the real router in PD mode in front of them (its own process)."""
    workers = [SglangWorker(s) for s in specs]
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for w in workers:
        if w.spec.mode == "prefill":
            cmd += ["--prefill", w.url, str(w.spec.bootstrap_port)]
        else:
            cmd += ["--decode", w.url]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    # its Prometheus exporter binds a fixed default port otherwise: parallel runs collide
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_registered(url, len(workers), proc, log)
        yield url, workers
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for w in workers:
            w.close()


def wait_registered(url: str, n: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            r = httpx.get(f"{url}/workers", timeout=2)
            if r.status_code == 200 and len(r.json().get("workers", [])) == n:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"router did not register {n} workers: {log.read_text()[-3000:]}")


def audit(url: str, out: Path, checks: str = "capacity,boundary,counters") -> tuple[int, Any]:
    res = CliRunner().invoke(
        main,
        ["audit", "--target", url, "--checks", checks, "--quiet", "--json", str(out)],
        catch_exceptions=False,
    )
    return res.exit_code, json.loads(out.read_text())


def specs(model: str, prefill_pools: list[int], decode_failures: float = 0.0) -> list[WorkerSpec]:
    out = [
        WorkerSpec(
            "prefill",
            [p],
            CONTEXT,
            model,
            bootstrap_port=9100 + i,
            counters={PD_FAILURES: 0, BOOTSTRAP_FAILURES: 0},
        )
        for i, p in enumerate(prefill_pools)
    ]
    out.append(
        WorkerSpec(
            "decode",
            [LARGE * 4],
            CONTEXT,
            model,
            counters={PD_FAILURES: decode_failures, BOOTSTRAP_FAILURES: 0},
        )
    )
    return out


def verdicts(rep: Any) -> dict[str, Any]:
    return {r["check"]: r for r in rep["results"]}


def test_one_short_prefill_node_fails_capacity_and_is_named(model_dir: str, tmp_path: Path) -> None:
    with fleet(specs(model_dir, [LARGE, SHORT]), tmp_path / "router.log") as (url, workers):
        code, rep = audit(url, tmp_path / "a.json")
        short = workers[1].url
        probes = [s for w in workers for s in w.seen if s.startswith("POST /v1/completions")]
    assert rep["targets"][0]["engine"] == "sglang-router"
    cap = verdicts(rep)["capacity"]
    assert code == 1
    assert cap["verdict"] == "fail"
    assert short in cap["summary"] and workers[0].url not in cap["summary"]
    nodes = {n["node"]: n for n in cap["evidence"]["nodes"]}
    assert set(nodes) == {w.url for w in workers}
    assert nodes[short]["pool_tokens"]["value"] == SHORT
    assert "internal_states" in nodes[short]["pool_tokens"]["source"]
    assert nodes[workers[2].url]["gated"] is False  # decode: reported, not gated
    assert nodes[workers[2].url]["role"]["value"] == "decode"
    assert probes  # the boundary rungs went through the router to the workers
    # the nodes' limits differ (4,089 vs 2,993): no false alarm from a prompt in between
    assert verdicts(rep)["boundary"]["verdict"] == "pass", verdicts(rep)["boundary"]["summary"]


def test_every_prefill_pool_large_passes(model_dir: str, tmp_path: Path) -> None:
    with fleet(specs(model_dir, [LARGE, LARGE]), tmp_path / "router.log") as (url, _):
        code, rep = audit(url, tmp_path / "a.json")
    v = verdicts(rep)
    assert v["capacity"]["verdict"] == "pass", v["capacity"]["summary"]
    assert v["boundary"]["verdict"] == "pass", v["boundary"]["summary"]
    assert v["counters"]["verdict"] == "pass", v["counters"]["summary"]
    assert code == 0
    salt = rep["targets"][0]["facts"]["cache_salt_supported"]
    assert salt["value"] is True and "/generate" in salt["note"]
    # the decode node's counters are watched too
    assert any(r["counter"].endswith(PD_FAILURES) for r in v["counters"]["evidence"]["counters"])


def test_decode_side_failures_during_the_audit_fail_counters(
    model_dir: str, tmp_path: Path
) -> None:
    with fleet(specs(model_dir, [LARGE]), tmp_path / "router.log") as (url, workers):
        decode = workers[-1]

        def fail_a_transfer_after_the_snapshot(path: str, body: dict[str, Any]) -> None:
            if path == "/v1/completions":  # a probe, after the snapshot
                decode.spec.counters[PD_FAILURES] = 7.0

        decode.on_post = fail_a_transfer_after_the_snapshot
        code, rep = audit(url, tmp_path / "a.json")
    counters = verdicts(rep)["counters"]
    assert counters["verdict"] == "fail"
    assert decode.url in counters["summary"] and "0 → 7" in counters["summary"]
    assert code == 1


def test_unreadable_prefill_node_is_inconclusive_never_pass(model_dir: str, tmp_path: Path) -> None:
    with fleet(specs(model_dir, [LARGE, LARGE]), tmp_path / "router.log") as (url, workers):
        hidden = workers[1]
        hidden.hide_info = True  # /server_info gone: only the router's /engine_metrics is left
        hidden.spec.enable_metrics = False  # ... and no metrics either
        code, rep = audit(url, tmp_path / "a.json", checks="capacity")
    cap = verdicts(rep)["capacity"]
    assert cap["verdict"] == "inconclusive"
    assert hidden.url in cap["summary"]
    assert code == 2


def test_a_node_without_server_info_is_gated_from_the_routers_engine_metrics(
    model_dir: str, tmp_path: Path
) -> None:
    with fleet(specs(model_dir, [LARGE, SHORT]), tmp_path / "router.log") as (url, workers):
        workers[1].hide_info = True
        code, rep = audit(url, tmp_path / "a.json", checks="capacity")
    cap = verdicts(rep)["capacity"]
    node = {n["node"]: n for n in cap["evidence"]["nodes"]}[workers[1].url]
    assert node["reached"] is False
    assert node["pool_tokens"]["value"] == SHORT
    assert "/engine_metrics" in node["pool_tokens"]["source"]
    assert cap["verdict"] == "fail" and workers[1].url in cap["summary"]
    assert code == 1


def test_a_fleet_of_decode_nodes_only_is_never_a_capacity_pass(replay: Any, model_dir: str) -> None:
    """The router's shapes as seen live above, replayed, with one decode worker behind it."""
    decode = SglangWorker(WorkerSpec("decode", [LARGE * 4], CONTEXT, model_dir))
    try:
        replay.json(
            "/get_server_info", {"router_manager": True, "routers_count": 1, "workers_count": 1}
        )
        row = {
            "url": decode.url,
            "worker_type": "decode",
            "metadata": {"disaggregation_mode": "decode"},
        }
        replay.json("/workers", {"workers": [row], "total": 1})
        replay.json(
            "/v1/models", {"object": "list", "data": [{"id": model_dir, "owned_by": "local"}]}
        )
        ctx = AuditContext()
        with ctx.open():
            target = detect(replay.url, ctx.client_for_url(replay.url))
            res = run_check(CapacityCheck(), ctx, target)
    finally:
        decode.close()
    assert target.engine == "sglang-router"
    assert res.verdict is Verdict.INCONCLUSIVE
    assert "no prefill node" in res.summary
