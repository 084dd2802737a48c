"""`kvfence serve --disaggregated --router sglang`: the real stack as one supervised command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    raw = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in raw.split()]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_one_command_serves_and_stops_whole_when_a_worker_dies(
    sgl_checkpoint: Path, tmp_path: Path
) -> None:
    kvfence = Path(sys.executable).with_name("kvfence")
    cmd = [str(kvfence), "serve", "--disaggregated", "--router", "sglang"]
    cmd += [
        "--model",
        str(sgl_checkpoint),
        "--model-kind",
        "mirror",
        "--kv-pages",
        "64",
        "--context-length",
        "512",
    ]
    out_path = tmp_path / "stack.out"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "tenant tenant-a" not in out_path.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, out_path.read_text()
            time.sleep(0.2)
        text = out_path.read_text()
        url = re.search(r"sglang-router \(PD mode\) at (\S+)", text)
        key = re.search(r"tenant tenant-a: key (\S+)", text)
        assert url and key, text
        r = httpx.post(
            f"{url[1]}/v1/completions",
            headers={"Authorization": f"Bearer {key[1]}"},
            json={"model": sgl_checkpoint.name, "prompt": "hello there", "max_tokens": 3},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert _salt_hits(url[1], key[1], sgl_checkpoint.name) == {
            "/v1/completions": (True, False),  # same salt hits, another salt misses
            "/v1/chat/completions": (True, True),  # sglang-router 0.3.2 drops the salt here
        }
        kids = _children(proc.pid)
        assert len(kids) == 4  # the router, its edge and two workers: children of the command
        decode = next(p for p in kids if "--role decode" in _cmdline(p))
        os.kill(decode, signal.SIGKILL)
        assert proc.wait(30) != 0
        assert "decode-1 exited" in out_path.read_text()
        for p in kids:
            assert not Path(f"/proc/{p}").exists() or "zombie" in _state(p)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/status").read_text().lower()


def _salt_hits(url: str, key: str, model: str) -> dict[str, tuple[bool, bool]]:
    """Per route: (a repeat with the same salt hit the cache, one with another salt hit it)."""
    out = {}
    for i, path in enumerate(("/v1/completions", "/v1/chat/completions")):
        text = f"salted workload {i} " * 40
        body: dict[str, object] = {"model": model, "max_tokens": 1}
        body |= (
            {"prompt": text}
            if "chat" not in path
            else {"messages": [{"role": "user", "content": text}]}
        )
        hits = []
        for salt in ("one", "one", "two"):
            r = httpx.post(
                url + path,
                headers={"Authorization": f"Bearer {key}"},
                json={**body, "cache_salt": f"{salt}-{i}"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            hits.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0)
        assert not hits[0]  # a cold prompt
        out[path] = (hits[1], hits[2])
    return out
