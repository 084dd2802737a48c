"""`kvfence serve` as a real process: the embedded default, a tenants file, clean Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

KVFENCE = str(Path(sys.executable).parent / "kvfence")


def start(args: list[str], cache: Path) -> tuple[subprocess.Popen[str], list[str]]:
    env = {**os.environ, "KVFENCE_CACHE": str(cache)}
    proc = subprocess.Popen(
        [KVFENCE, "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or not lines[-1].startswith("try: curl"):
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=30)
            raise AssertionError(f"serve exited {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
        lines.append(line.rstrip("\n"))
    return proc, lines


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


@pytest.mark.slow
def test_serve_with_no_arguments_runs_the_embedded_default(tmp_path: Path) -> None:
    proc, lines = start([], tmp_path / "cache")
    try:
        text = "\n".join(lines)
        url = re.search(r"at (http://127\.0\.0\.1:\d+)", text)
        keys = re.findall(r"tenant (\S+): key (sk-kvf-[0-9a-f]+)", text)
        assert url is not None and len(keys) == 2
        assert "capacity gate PASS" in text
        assert f"Authorization: Bearer {keys[0][1]}" in lines[-1]
        base = url.group(1)
        info = httpx.get(base + "/server_info", headers={"Authorization": f"Bearer {keys[1][1]}"})
        assert info.json()["auth"] == "api-key" and info.json()["model"] == "tiny-seed0"
        client = openai.OpenAI(base_url=base + "/v1", api_key=keys[0][1], max_retries=0)
        r = client.completions.create(model="tiny-seed0", prompt="Hello", max_tokens=4)
        assert r.usage is not None and r.usage.completion_tokens == 4
        assert (tmp_path / "cache" / "models" / "tiny-seed0" / "model.safetensors").is_file()
    finally:
        err = stop(proc)
    assert "kvfence: stopped" in err


@pytest.mark.slow
def test_serve_with_a_tenants_file_and_the_mirror_model(tmp_path: Path, checkpoint: Path) -> None:
    tenants = tmp_path / "tenants.json"
    key_a, key_b = "sk-team-a-" + "1" * 24, "sk-team-b-" + "2" * 24
    key_op = "sk-operator-" + "3" * 24
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {"name": "team-a", "keys": [key_a]},
                    {"name": "team-b", "keys": [key_b]},
                ],
                "operator_keys": [key_op],
            }
        )
    )
    args = ["--model", str(checkpoint), "--model-kind", "mirror", "--tenants", str(tenants)]
    args += ["--lab-fault", "no-invalidate", "--kv-pages", "512"]
    proc, lines = start(args, tmp_path / "cache")
    try:
        base = re.search(r"at (http://127\.0\.0\.1:\d+)", "\n".join(lines)).group(1)  # type: ignore[union-attr]
        assert f"tenant team-a: key {key_a}" in lines
        h = {"Authorization": f"Bearer {key_b}"}
        op = {"Authorization": f"Bearer {key_op}"}
        info = httpx.get(base + "/server_info", headers=op).json()
        assert info["lab"]["faults"] == ["no-invalidate"]
        assert info["pools"][0]["pool_tokens"] == 512 * 16
        assert "lab" not in httpx.get(base + "/server_info", headers=h).json()
        assert httpx.get(base + "/metrics", headers=h).status_code == 403
        n = httpx.post(base + "/tokenize", headers=h, json={"prompt": "mirror me"}).json()["count"]
        r = httpx.post(
            base + "/v1/completions",
            headers=h,
            json={"prompt": "mirror me", "max_tokens": n, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "mirror me"
        assert (
            httpx.get(base + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code
            == 401
        )
    finally:
        stop(proc)


def test_bad_tenants_file_is_a_usage_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvfence.cli import main

    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"tenants": [{"name": "a", "keys": ["short"]}]}))
    result = CliRunner().invoke(main, ["serve", "--tenants", str(bad)])
    assert result.exit_code == 2 and ">= 16" in result.stderr
    result = CliRunner().invoke(main, ["serve", "--no-auth", "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "loopback" in result.stderr
