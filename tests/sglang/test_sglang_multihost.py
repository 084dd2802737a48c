"""Multi-host through the real sglang-router: router, prefill and decode each on its own host.

Each role runs in its own network namespace (`ip netns exec`, tests/pd/netns.py):
`python -m sglang_router.launch_router --pd-disaggregation` on the router host,
`kvfence serve --router sglang --role prefill|decode --transport mooncake` on
the two worker hosts, which share only a private /24 on a bridge. The KV goes
prefill -> decode by Mooncake's TCP transport across that link; the client is a
fourth host (threads that joined its namespace). One stack for the module.
Skipped (with the kernel's answer) only where `ip netns add` is refused, or
where the `pd` extra (Mooncake) is not installed.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "pd"))  # tests/pd: netns.py, test_pd_e2e.py
from netns import NamespacesRefused, NetLab, netlab, popen_on, stop_all, tail
from test_pd_e2e import PROMPTS, _complete, _single_process_texts

from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.tenants import TenantRegistry
from kvfence.sglang_stack.worker import ANNOUNCE

pytestmark = pytest.mark.slow

HOSTS = ("router", "prefill", "decode", "client")
ROUTER_PORT, METRICS_PORT = 8000, 29000  # fixed: the router host is a fresh namespace
T = TypeVar("T")


@dataclass
class Hosts:
    lab: NetLab
    tenants: TenantRegistry
    secret: str
    logs: dict[str, Path]
    workers: dict[str, dict[str, Any]]  # role -> its announce (url, bootstrap_port)
    model: str = "tiny"

    @property
    def url(self) -> str:
        return f"http://{self.lab.ip('router')}:{ROUTER_PORT}"

    def key(self, tenant: str = "a") -> str:
        return next(t.keys[0] for t in self.tenants.tenants if t.name == tenant)

    def on_client(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn on the client host (a thread inside the client namespace)."""
        with self.lab.threads_on("client", 1) as pool:
            return pool.submit(fn, *args).result(timeout=300)

    def diagnostics(self) -> str:
        return "\n".join(f"--- {name} ---\n{tail(path)}" for name, path in self.logs.items())


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    pytest.importorskip("mooncake.engine", reason="the `pd` extra (Mooncake) is not installed")
    try:
        with netlab(HOSTS) as made:
            yield made
    except NamespacesRefused as e:
        pytest.skip(f"network namespaces are not available here: {e}")


def _worker_argv(lab: NetLab, role: str, ckpt: Path, tmp: Path) -> list[str]:
    return [
        sys.executable, "-m", "kvfence", "serve", "--router", "sglang", "--role", role,
        "--model", str(ckpt), "--model-kind", "llama", "--transport", "mooncake",
        "--kv-pages", "prefill=512,decode=512", "--torch-threads", "1",
        "--router-secret-file", str(tmp / "router.secret"), "--tenants", str(tmp / "tenants.json"),
        "--host", lab.ip(role), "--port", "0", "--kv-host", lab.ip(role),
    ]  # fmt: skip


def _router_argv(lab: NetLab, hosts: Hosts) -> list[str]:
    pre, dec = hosts.workers["prefill"], hosts.workers["decode"]
    ip = lab.ip("router")
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", f"{pre['url']}/r/{hosts.secret}", str(pre["bootstrap_port"]),
        "--decode", f"{dec['url']}/r/{hosts.secret}",
        "--host", ip, "--port", str(ROUTER_PORT), "--policy", "round_robin",
        "--prometheus-host", ip, "--prometheus-port", str(METRICS_PORT),
    ]  # fmt: skip


def _announced(hosts: Hosts, role: str, procs: dict[str, Any], end: float) -> dict[str, Any]:
    while time.monotonic() < end:
        for line in tail(hosts.logs[role], 100_000).splitlines():
            if line.startswith(ANNOUNCE):
                return dict(json.loads(line[len(ANNOUNCE) :]))
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        assert not dead, f"a role exited during start-up: {dead}\n{hosts.diagnostics()}"
        time.sleep(0.2)
    raise AssertionError(f"{role} did not announce itself\n{hosts.diagnostics()}")


def _registered(hosts: Hosts) -> bool:
    try:
        with httpx.Client(trust_env=False, timeout=5) as http:
            listed = http.get(hosts.url + "/workers").json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return False
    return len([w for w in listed if w.get("is_healthy")]) == 2


@pytest.fixture(scope="module")
def hosts(
    lab: NetLab, sgl_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hosts]:
    tmp = tmp_path_factory.mktemp("sgl-multihost")
    tenants = TenantRegistry.generate(("a", "b"))
    logs = {r: tmp / f"{r}.log" for r in HOSTS[:3]}
    h = Hosts(lab, tenants, secrets.token_hex(16), logs, {}, sgl_checkpoint.name)
    for name, text in (("router.secret", h.secret), ("tenants.json", tenants.to_json())):
        (tmp / name).touch(mode=0o600)
        (tmp / name).write_text(text)
    procs: dict[str, Any] = {}
    try:
        for role in ("prefill", "decode"):
            procs[role] = popen_on(
                lab, role, _worker_argv(lab, role, sgl_checkpoint, tmp), h.logs[role]
            )
        end = time.monotonic() + 240
        h.workers = {role: _announced(h, role, procs, end) for role in ("prefill", "decode")}
        procs["router"] = popen_on(lab, "router", _router_argv(lab, h), h.logs["router"])
        while not h.on_client(_registered, h):
            dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            assert not dead and time.monotonic() < end, f"{dead}\n{h.diagnostics()}"
            time.sleep(0.5)
        yield h
    finally:
        stop_all(list(procs.values()))


def _texts(h: Hosts) -> list[str]:
    with httpx.Client(trust_env=False, timeout=120) as http:
        client = openai.OpenAI(
            base_url=f"{h.url}/v1", api_key=h.key(), max_retries=0, http_client=http
        )
        return [_complete(client, h.model, p) for p in PROMPTS]


def _decode_facts(h: Hosts) -> dict[str, Any]:
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.get(f"{h.workers['decode']['url']}/r/{h.secret}/server_info")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_router_and_mooncake_across_hosts_equal_single_process(
    hosts: Hosts, sgl_checkpoint: Path
) -> None:
    rx0, _ = hosts.lab.eth0_bytes("decode")
    got = hosts.on_client(_texts, hosts)
    rx1, _ = hosts.lab.eth0_bytes("decode")
    facts = hosts.on_client(_decode_facts, hosts)
    assert facts["disaggregation_transfer_backend"] == "mooncake", facts
    # The KV really crossed the link: decode's only interface received at least the
    # longest prompt's pages, and every byte of them came from the prefill host.
    geometry = ModelConfig.from_file(sgl_checkpoint / "config.json").kv_geometry(page_size=16)
    longest = max(len(Tokenizer.from_dir(sgl_checkpoint).encode(p)) for p in PROMPTS)
    assert rx1 - rx0 >= longest * geometry.bytes_per_token, (rx0, rx1)
    assert got == _single_process_texts(sgl_checkpoint), hosts.diagnostics()


def test_a_tenants_bootstrap_room_straight_to_a_worker_is_refused(hosts: Hosts) -> None:
    """From the client host, a tenant's key and a room, to each worker's own URL: 400 (I9)."""

    def direct(role: str) -> httpx.Response:
        body = {"model": hosts.model, "prompt": "hi", "max_tokens": 2, "bootstrap_room": 7}
        with httpx.Client(trust_env=False, timeout=60) as http:
            return http.post(
                f"{hosts.workers[role]['url']}/v1/completions",
                headers={"Authorization": f"Bearer {hosts.key('b')}"},
                json=body,
            )

    for role in ("prefill", "decode"):
        r = hosts.on_client(direct, role)
        assert r.status_code == 400, (role, r.text)
        assert r.json()["error"]["param"] == "bootstrap_room", (role, r.text)
    assert re.match(r"http://10\.", hosts.workers["prefill"]["url"]), hosts.workers
