"""A vLLM P/D fleet audited through the real vllm-router 0.1.17 (PD mode) on loopback.

vllm-router forwards `/get_server_info` and `/v1/models` to its first prefill
worker, so without `/workers` the audit would take the fleet for that one
node. The workers replay vLLM 0.32's NIXL metrics (fixtures/vllm) with the
pool each test needs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from audit_replay import FIXTURES, ReplayServer, Route, serve
from click.testing import CliRunner
from test_audit_fleet import free_port

from kvfence.cli import main

pytestmark = pytest.mark.slow

VLLM = FIXTURES / "vllm"
MAX_MODEL_LEN = 2048


def vllm_worker(role: str, pool: int) -> tuple[ReplayServer, Any]:
    """A vLLM 0.32-shaped NIXL node whose one engine holds `pool` tokens."""
    text = (VLLM / f"0.32.0-nixl-{role}.metrics.txt").read_text()
    text = re.sub(r'kv_cache_size_tokens="\d+"', f'kv_cache_size_tokens="{pool}"', text)
    state = ReplayServer()
    state.routes[("GET", "/metrics")] = Route(200, text, "text/plain")
    state.routes[("GET", "/health")] = Route(200, "")
    models = json.loads((VLLM / "0.32.0.models.json").read_text())
    models["data"][0]["max_model_len"] = MAX_MODEL_LEN
    state.json("/v1/models", models)
    httpd, thread = serve(state)
    return state, (httpd, thread)


@contextmanager
def vllm_fleet(pools: list[int], log: Path) -> Iterator[tuple[str, list[ReplayServer]]]:
    nodes = [vllm_worker("prefill", p) for p in pools] + [vllm_worker("decode", 4 * MAX_MODEL_LEN)]
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
    for state, _ in nodes[:-1]:
        cmd += ["--prefill", state.url]
    cmd += ["--decode", nodes[-1][0].url, "--host", "127.0.0.1", "--port", str(port)]
    # its Prometheus exporter binds a fixed default port otherwise: parallel runs collide
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                r = httpx.get(f"{url}/workers", timeout=2)
                if r.status_code == 200 and r.json().get("total") == len(nodes):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url, [state for state, _ in nodes]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for _, (httpd, thread) in nodes:
            httpd.shutdown()
            httpd.server_close()
            thread.join()


def audit(url: str, out: Path) -> tuple[int, Any]:
    res = CliRunner().invoke(
        main,
        ["audit", "--target", url, "--checks", "capacity,counters", "--quiet", "--json", str(out)],
        catch_exceptions=False,
    )
    rep = json.loads(out.read_text())
    return res.exit_code, {r["check"]: r for r in rep["results"]} | {"_targets": rep["targets"]}


def test_vllm_router_fleet_names_the_short_prefill_node(tmp_path: Path) -> None:
    with vllm_fleet([8192, 2000], tmp_path / "router.log") as (url, nodes):
        code, v = audit(url, tmp_path / "a.json")
    assert v["_targets"][0]["engine"] == "vllm-router"
    cap = v["capacity"]
    assert cap["verdict"] == "fail" and code == 1
    assert nodes[1].url in cap["summary"] and nodes[0].url not in cap["summary"]
    rows = {n["node"]: n for n in cap["evidence"]["nodes"]}
    assert rows[nodes[1].url]["pool_tokens"]["value"] == 2000
    assert rows[nodes[2].url]["role"]["value"] == "decode" and not rows[nodes[2].url]["gated"]


def test_vllm_router_fleet_with_large_prefill_pools_passes(tmp_path: Path) -> None:
    with vllm_fleet([8192, 8192], tmp_path / "router.log") as (url, nodes):
        code, v = audit(url, tmp_path / "a.json")
    assert v["capacity"]["verdict"] == "pass", v["capacity"]["summary"]
    assert v["counters"]["verdict"] == "pass", v["counters"]["summary"]
    watched = {r["counter"] for r in v["counters"]["evidence"]["counters"]}
    assert f"{nodes[2].url} vllm:nixl_num_failed_transfers" in watched  # decode's too
    assert code == 0
