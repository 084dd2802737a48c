"""Disaggregated serving on real processes over loopback: same answers, isolation, failures."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
from pd_helpers import TENANTS, cluster

from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.app import create_app
from kvfence.serve.build import LocalSpec, PoolSizes, build_local
from kvfence.serve.tenants import TenantRegistry
from kvfence.serve.thread import ServerThread

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox", "Tenant isolation holds by construction.", "KV pages " * 20, "a"]


def _single_process_texts(
    checkpoint: Path,
    *,
    prompts: Sequence[str] = PROMPTS,
    complete: Callable[[openai.OpenAI, str, str], Any] | None = None,
    context_length: int | None = None,
    pages: int = 512,
) -> list[Any]:
    """Each prompt's greedy answer (`complete`, by default its text) from one process."""
    parts = build_local(
        LocalSpec(
            checkpoint,
            kind="llama",
            context_length=context_length,
            pools=PoolSizes(prefill_pages=pages, decode_pages=pages),
        )
    )
    complete = complete or _complete
    tenants = TenantRegistry.generate(("a",))
    app = create_app(parts.pipeline, parts.loaded.tokenizer, parts.config, tenants)
    parts.pipeline.start()
    try:
        with ServerThread(app) as srv:
            client = openai.OpenAI(
                base_url=f"{srv.url}/v1", api_key=tenants.tenants[0].keys[0], max_retries=0
            )
            return [complete(client, checkpoint.name, p) for p in prompts]
    finally:
        parts.pipeline.stop()


def _complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 12
    return r.choices[0].text


@pytest.mark.parametrize("transport", ["tcp", "shm", "mooncake", "nixl"])
def test_disaggregated_equals_single_process(pd_checkpoint: Path, transport: str) -> None:
    expected = _single_process_texts(pd_checkpoint)
    with cluster(pd_checkpoint, kind="llama", transport=transport) as c:
        got = [_complete(c.client(), c.model, p) for p in PROMPTS]
        info = c.info()
        assert info["disaggregated"] is True and info["transport"] == transport
        assert {p["role"] for p in info["pools"]} == {
            "prefill",
            "decode",
        }  # read from the live workers
        assert set(c.wait_quiet().values()) == {"ok"}
    assert got == expected


def test_tenants_get_their_own_echo_across_processes(pd_checkpoint: Path) -> None:
    """16 concurrent streams from 4 tenants on the mirror model: each echoes exactly its own prompt."""
    tokenizer = Tokenizer.from_dir(pd_checkpoint)
    with cluster(pd_checkpoint, kind="mirror", n_decode=2) as c:

        def run(i: int) -> tuple[str, str]:
            tenant = TENANTS[i % 4]
            prompt = f"tenant {tenant} request {i:02d} secret-{i * 7919:05d} "
            stream = c.client(tenant).completions.create(
                model=c.model,
                prompt=prompt,
                max_tokens=len(tokenizer.encode(prompt)),
                temperature=0,
                stream=True,
            )
            return prompt, "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(run, range(16)))
        for prompt, text in results:
            assert text == prompt
        assert set(c.wait_quiet().values()) == {"ok"}
        assert c.info()["pools"]  # still serving


def test_decode_death_fails_its_requests_only(pd_checkpoint: Path) -> None:
    with cluster(pd_checkpoint, kind="llama", n_decode=2) as c:
        client = c.client(timeout=600)

        def long_request(i: int) -> str:
            try:
                r = client.completions.create(
                    model=c.model,
                    prompt=f"request {i}",
                    max_tokens=400,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                return f"ok:{r.usage.completion_tokens if r.usage else 0}"
            except openai.APIStatusError as e:
                return f"error:{e.status_code}"

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(long_request, i) for i in range(4)]
            decode0 = c.inboxes["decode-0"]
            end = time.monotonic() + 120
            while time.monotonic() < end:  # kill it while it is generating, not before
                if any(s == ("decode", decode0) for s in c.backend.stages().values()):
                    break
                time.sleep(0.01)
            c.signal("decode-0", signal.SIGKILL)
            outcomes = [f.result(timeout=500) for f in futures]
        assert any(o.startswith("error:503") for o in outcomes), (
            outcomes
        )  # decode-0's requests fail, loudly
        assert any(o == "ok:400" for o in outcomes), outcomes  # decode-1's complete in full
        assert not any(o.startswith("ok:") and o != "ok:400" for o in outcomes)  # never a short 200
        # New requests avoid the dead worker.
        assert _complete(client, c.model, "after the crash")
        reports = c.wait_quiet()
        assert set(reports.values()) == {"ok"} and c.inboxes["decode-0"] not in reports


@pytest.mark.parametrize("transport", ["tcp", "mooncake", "nixl"])
def test_prefill_frozen_then_dead_never_lands_late(pd_checkpoint: Path, transport: str) -> None:
    """A prefill worker stops mid-request: the request fails with an error and decode's pages
    are released only once no transfer can land (I7); when it wakes, its late transfer is refused."""
    with cluster(pd_checkpoint, kind="mirror", n_prefill=2, transport=transport) as c:
        c.signal("prefill-0", signal.SIGSTOP)
        client = c.client()
        outcomes = []
        for i in range(2):  # round robin: one of these goes to the frozen worker
            try:
                r = client.completions.create(
                    model=c.model, prompt=f"frozen {i} " * 8, max_tokens=4, temperature=0
                )
                outcomes.append(r.choices[0].text)
            except openai.APIStatusError as e:
                outcomes.append(f"error:{e.status_code}:{e.message}")
        assert sum(o.startswith("error:503") for o in outcomes) == 1, outcomes
        assert sum(o.startswith("frozen") for o in outcomes) == 1, outcomes
        c.signal(
            "prefill-0", signal.SIGCONT
        )  # it wakes and tries to send KV into a cancelled reservation
        for i in range(4):
            assert _complete(client, c.model, f"after {i}")
        decode = c.backend.worker_status(c.inboxes["decode-0"])
        assert decode is not None and decode.counters.isolation_violations == 0
        assert set(c.wait_quiet().values()) == {"ok"}


def test_malformed_control_message_is_refused_not_fatal(pd_checkpoint: Path) -> None:
    with cluster(pd_checkpoint, kind="mirror") as c:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(c.inboxes["decode-0"])
        for frame in (
            b"not json",
            b'{"type":"Bootstrap","body":{"room":1}}',
            b'{"type":"Nope","body":{}}',
        ):
            sock.send(frame)
        sock.close(linger=1000)
        ctx.term()
        assert _complete(c.client(), c.model, "still serving").startswith("still serving")
        end = time.monotonic() + 30
        while time.monotonic() < end:
            status = c.backend.worker_status(c.inboxes["decode-0"])
            if status is not None and status.refused_messages >= 3:
                break
            time.sleep(0.1)
        assert status is not None and status.refused_messages == 3


def _pids(pattern: str) -> list[int]:
    """The processes with `pattern` in their command line."""
    out = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def _running(pattern: str) -> int:
    return len(_pids(pattern))


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _serve_announced(
    args: list[str], env: dict[str, str] | None = None, sigint_ignored: bool = False
) -> tuple[subprocess.Popen[str], str]:
    """`kvfence serve ARGS` started, and what it printed up to its ready-to-paste curl line.

    `sigint_ignored` starts it the way a shell starts a background job (`kvfence serve … &`
    in a script): SIGINT inherited ignored, which Python keeps unless the program sets it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfence", "serve", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ignore_sigint if sigint_ignored else None,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    end = time.monotonic() + 240
    while time.monotonic() < end and not (lines and lines[-1].startswith("try: curl")):
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    return proc, "".join(lines)


def test_serve_disaggregated_command(pd_checkpoint: Path, tmp_path: Path) -> None:
    """`kvfence serve --disaggregated`: children on loopback, a real request, Ctrl-C stops them all.

    The supervisor hands each role its spec as a file in its temporary folder (under
    TMPDIR, here tmp_path), so every child's command line names tmp_path."""
    args = ["--disaggregated", "--router", "kvfence", "--model", str(pd_checkpoint)]
    args += ["--model-kind", "mirror"]
    args += ["--kv-pages", "512", "--transport", "shm"]
    proc, text = _serve_announced(args, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        url = m.group(1) if (m := re.search(r"at (http://\S+)", text)) else None
        key = m.group(1) if (m := re.search(r"key (sk-kvf-\w+)", text)) else None
        assert url and key, text
        r = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": pd_checkpoint.name,
                "prompt": "hello pd",
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hello pd")
        info = httpx.get(
            f"{url}/server_info", headers={"Authorization": f"Bearer {key}"}, timeout=30
        ).json()
        assert info["disaggregated"] and info["transport"] == "shm"
        # The worker group and the two workers it forked (they keep its command line; their
        # process names tell them apart), not fresh interpreters: torch was imported once.
        group = _pids(f"kvfence.hub.worker_group {tmp_path}")
        assert len(group) == 3, group
        names = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in group)
        # The group keeps the interpreter's own name (python or python3, by installation).
        assert names[:2] == ["kvf-decode-0", "kvf-prefill-0"], names
        assert names[2].startswith("python"), names
        assert _running(f"kvfence.hub.worker_entry {tmp_path}") == 0
        assert _running(f"kvfence.hub.router_entry {tmp_path}") == 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert "stopping" in out
    assert _running(f"--model {pd_checkpoint}") == 0
    assert _running(str(tmp_path)) == 0


def _worker_pid(tmp_path: Path, name: str) -> int:
    """The pid of the worker `name` (prefill-0) under the supervisor whose specs are in tmp_path."""
    for pid in _pids(f"kvfence.hub.worker_group {tmp_path}"):
        if Path(f"/proc/{pid}/comm").read_text().strip() == f"kvf-{name}":
            return pid
    raise AssertionError(f"no process named kvf-{name}")


def test_a_forked_worker_killed_stops_every_role_and_is_named(
    pd_checkpoint: Path, tmp_path: Path
) -> None:
    """kill -9 of the forked prefill worker: the group names it, stops decode, and the
    supervisor stops the router; nothing with the spec folder in its command line is left."""
    args = ["--disaggregated", "--router", "kvfence", "--model", str(pd_checkpoint)]
    args += ["--model-kind", "mirror", "--kv-pages", "512"]
    proc, text = _serve_announced(args, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert "try: curl" in text, text
        os.kill(_worker_pid(tmp_path, "prefill-0"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, out
    assert "prefill-0 exited with code 137; stopping the other workers" in out, out
    assert "workers exited with code 137" in out, out
    assert _running(str(tmp_path)) == 0


def test_workers_start_as_interpreters_when_the_group_cannot_fork_safely(
    pd_checkpoint: Path, tmp_path: Path
) -> None:
    """A thread in the group (here numpy's OpenBLAS server, asked for) means no fork: each
    worker starts as its own interpreter, as before the group, and serves the same."""
    args = ["--disaggregated", "--router", "kvfence", "--no-auth", "--port", "0"]
    args += ["--model", str(pd_checkpoint), "--model-kind", "mirror", "--kv-pages", "512"]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OPENBLAS_NUM_THREADS": "2"}
    proc, text = _serve_announced(args, env=env)
    try:
        url = re.search(r"at (http://\S+)", text)
        assert url is not None, text
        assert "cannot fork safely" in text, text
        assert _running(f"kvfence.hub.worker_entry {tmp_path}") == 2
        body = {"prompt": "hello group", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url.group(1)}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hello group")
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert "stopping" in out
    assert _running(str(tmp_path)) == 0


def test_serve_disaggregated_no_auth(pd_checkpoint: Path) -> None:
    """`--disaggregated --no-auth` starts (the keyless dev tenant reaches the router as
    `no_auth` in its spec, not as a tenants file it would refuse) and serves a request with
    no key."""
    args = ["--disaggregated", "--router", "kvfence", "--no-auth", "--port", "0"]
    args += ["--model", str(pd_checkpoint)]
    args += ["--model-kind", "mirror", "--kv-pages", "512"]
    proc, text = _serve_announced(args, sigint_ignored=True)  # kill -INT still stops it all
    try:
        url = re.search(r"at (http://\S+)", text)
        assert url is not None and "auth: none (dev mode" in text, text
        body = {"prompt": "hello dev", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url.group(1)}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hello dev")
        info = httpx.get(f"{url.group(1)}/server_info", timeout=30).json()
        assert info["auth"] == "none" and info["disaggregated"] is True
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "stopping" in out, out


def test_no_auth_stays_loopback_only_when_disaggregated() -> None:
    from click.testing import CliRunner

    from kvfence.cli import main

    args = ["serve", "--disaggregated", "--router", "kvfence", "--no-auth", "--host", "0.0.0.0"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "only allowed on a loopback host" in result.output
