"""Each pod's gate command, taken from its manifest, against real kvfence engines on
loopback: exit 1 where the live pool is short of context x headroom (the pod stays
un-Ready), 0 where it is not (the pod becomes Ready), 2 where the operator key the Secret
provides is missing (facts withheld: still un-Ready).

Only the engine's address is rewritten (the pod's localhost port to the loopback engine's);
the environment is the sidecar's, its Secret reference resolved to this engine's operator
key. The engines are kvfence's own (the tiny real transformer, context 512): a short one
with 21 pages of 16 tokens (336 < 512 x 1.25 = 640, served with --allow-undersized-pool),
and one with 64 (1,024 >= 640)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from deploy_files import containers, gate_probe, of_kind

from kvfence.model.tiny import make_tiny_checkpoint
from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, build_local
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

CONTEXT = 512
SHORT_PAGES, ENOUGH_PAGES = 21, 64  # x 16 tokens: 336 and 1,024 against 640 required


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gate-ckpt") / "tiny", seed=0)


@contextmanager
def engine(checkpoint: Path, pages: int) -> Iterator[tuple[str, str]]:
    """A kvfence engine on loopback with `pages` pages per role; (its URL, operator key)."""
    parts = build_local(
        LocalSpec(
            checkpoint,
            context_length=CONTEXT,
            pools=PoolSizes(prefill_pages=pages, decode_pages=pages),
            allow_undersized_pool=pages * 16 < CONTEXT * 1.25,
        )
    )
    tenants = TenantRegistry.generate()
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    parts.pipeline.start()
    try:
        with ServerThread(app) as srv:
            yield srv.url, tenants.operator_keys[0]
    finally:
        parts.pipeline.stop()


@pytest.fixture(scope="module")
def engines(checkpoint: Path) -> Iterator[dict[str, tuple[str, str]]]:
    with engine(checkpoint, SHORT_PAGES) as short, engine(checkpoint, ENOUGH_PAGES) as enough:
        yield {"short": short, "enough": enough}


def pod(name: str) -> dict[str, Any]:
    (dep,) = (d for d in of_kind("Deployment") if d["metadata"]["name"] == name)
    return dep


def sidecar_env(dep: dict[str, Any], operator_key: str | None) -> dict[str, str]:
    """The gate container's environment: its Secret references resolved (the operator key
    is the only one it reads), every other variable as the manifest sets it."""
    (gate,) = (c for c in containers(dep) if c["name"] == "kvfence-gate")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for var in gate["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            env[var["name"]] = var["value"]
            continue
        assert ref["key"] == "operator-key", ref
        if operator_key is not None:
            env[var["name"]] = operator_key
    return env


def run_gate(name: str, url: str, operator_key: str | None) -> subprocess.CompletedProcess[str]:
    dep = pod(name)
    engine_port = next(c for c in containers(dep) if c["name"] == "engine")["ports"][0]
    pod_url = f"http://127.0.0.1:{engine_port['containerPort']}"
    command = gate_probe(dep)
    rewritten = [word.replace(pod_url, url) for word in command]
    assert rewritten != command, f"{pod_url} not in {command}"
    return subprocess.run(
        rewritten, capture_output=True, text=True, env=sidecar_env(dep, operator_key), timeout=120
    )


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_the_gate_fails_a_short_pool_and_passes_an_adequate_one(
    name: str, engines: dict[str, tuple[str, str]]
) -> None:
    url, key = engines["short"]
    short = run_gate(name, url, key)
    assert short.returncode == 1, short.stdout + short.stderr
    assert "fails: capacity" in short.stdout, short.stdout
    url, key = engines["enough"]
    enough = run_gate(name, url, key)
    assert enough.returncode == 0, enough.stdout + enough.stderr


def test_without_the_operator_key_the_gate_cannot_pass(engines: dict[str, tuple[str, str]]) -> None:
    """kvfence's engine withholds its pool from a caller without the operator key: the
    gate is inconclusive (exit 2), never a pass, so a pod whose Secret is missing stays
    un-Ready."""
    url, _ = engines["enough"]
    bare = run_gate("vllm", url, None)
    assert bare.returncode == 2, bare.stdout + bare.stderr
