"""Multi-host disaggregation: router, prefill and decode each on its own network host (issue 4).

Every role runs `kvfence serve --role …` inside its own network namespace
(`ip netns exec`); the hosts share only a private /24 on a bridge, and the KV
goes prefill -> decode over the TCP transport on that link. The client is a
fourth host: the test's requests are sent from threads that joined the
`client` namespace, so they cross the bridge too. Skipped (with the kernel's
answer) only where `ip netns add` is refused.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
from netns import NamespacesRefused, NetLab, namespaces_named, netlab, stop_all, tail
from test_pd_e2e import PROMPTS, _complete, _single_process_texts

from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import Tokenizer
from kvfence.serve.tenants import TenantRegistry

pytestmark = pytest.mark.slow

HOSTS = ("router", "prefill", "decode", "client")
T = TypeVar("T")


@dataclass
class MultiHost:
    lab: NetLab
    url: str
    model: str
    tenants: TenantRegistry
    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    _http: list[httpx.Client] = field(default_factory=list)

    def key(self, tenant: str = "a") -> str:
        if tenant == "operator":
            return self.tenants.operator_keys[0]
        return next(t.keys[0] for t in self.tenants.tenants if t.name == tenant)

    def client(self, tenant: str = "a") -> openai.OpenAI:
        # trust_env=False: a proxy from the environment must never carry these requests.
        http = httpx.Client(trust_env=False, timeout=120)
        self._http.append(http)
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.key(tenant), max_retries=0, http_client=http
        )

    def on_client(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn on the client host (a thread inside the client namespace)."""
        with self.lab.threads_on("client", 1) as pool:
            return pool.submit(fn, *args).result(timeout=300)

    def map_on_client(self, fn: Callable[[int], T], n: int) -> list[T]:
        with self.lab.threads_on("client", n) as pool:
            return list(pool.map(fn, range(n), timeout=300))

    def info(self) -> dict[str, object]:
        def get() -> dict[str, object]:
            with httpx.Client(trust_env=False, timeout=30) as http:
                r = http.get(
                    self.url + "/server_info",
                    headers={"Authorization": f"Bearer {self.key('operator')}"},
                )
            assert r.status_code == 200, r.text
            return dict(r.json())

        return self.on_client(get)

    def diagnostics(self) -> str:
        return "\n".join(f"--- {name} ---\n{tail(path)}" for name, path in self.logs.items())

    def close_clients(self) -> None:
        for http in self._http:
            http.close()


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    try:
        with netlab(HOSTS) as made:
            yield made
    except NamespacesRefused as e:
        pytest.skip(f"network namespaces are not available here: {e}")


def _popen(lab: NetLab, host: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            lab.exec_argv(host, [sys.executable, "-m", "kvfence", "serve", *argv]),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_for_router(cluster: MultiHost, deadline_s: float = 240) -> str:
    """The URL the router announces once both workers reported and the gate passed."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        m = re.search(r"kvfence serving \S+ at (http://\S+)", tail(cluster.logs["router"], 10_000))
        if m:
            return m.group(1)
        dead = {n: p.returncode for n, p in cluster.procs.items() if p.poll() is not None}
        assert not dead, f"a role exited during start-up: {dead}\n{cluster.diagnostics()}"
        time.sleep(0.2)
    raise AssertionError(f"router not serving after {deadline_s} s\n{cluster.diagnostics()}")


@dataclass(frozen=True)
class Setup:
    name: str
    kind: str
    port_base: int  # router inbox; +1 prefill inbox, +2 decode inbox, +3 HTTP
    kv_host: str  # "decode" = the decode host's own address; else a literal address


# Started together (start-up is most of the cost); each has its own ports on the same hosts.
SETUPS = (
    Setup("llama", "llama", 7000, "decode"),
    Setup("mirror", "mirror", 7100, "decode"),
    # Decode listens for KV on its own loopback: the address it reports is unreachable
    # from the prefill host. Shows the cross-host tests can fail.
    Setup("loopback-kv", "mirror", 7200, "127.0.0.1"),
)


def _start(lab: NetLab, setup: Setup, checkpoint: Path, tmp: Path) -> MultiHost:
    tenants = TenantRegistry.generate(("a", "b", "c", "d"))
    tenants_file = tmp / "tenants.json"
    tenants_file.touch(mode=0o600)
    tenants_file.write_text(tenants.to_json())
    port = setup.port_base
    router_inbox = f"tcp://{lab.ip('router')}:{port}"
    prefill_inbox = f"tcp://{lab.ip('prefill')}:{port + 1}"
    decode_inbox = f"tcp://{lab.ip('decode')}:{port + 2}"
    kv_host = lab.ip("decode") if setup.kv_host == "decode" else setup.kv_host
    common = ["--model", str(checkpoint), "--model-kind", setup.kind, "--transport", "tcp"]
    worker = [*common, "--kv-pages", "prefill=512,decode=512", "--router-addr", router_inbox]
    argv = {
        "prefill": [*worker, "--role", "prefill", "--inbox", prefill_inbox],
        "decode": [*worker, "--role", "decode", "--inbox", decode_inbox, "--kv-host", kv_host],
        "router": [*common, "--role", "router", "--inbox", router_inbox,
                   "--prefill-addr", prefill_inbox, "--decode-addr", decode_inbox,
                   "--host", lab.ip("router"), "--port", str(port + 3),
                   "--tenants", str(tenants_file)],
    }  # fmt: skip
    logs = {host: tmp / f"{host}.log" for host in argv}
    c = MultiHost(lab, "", checkpoint.name, tenants, {}, logs)
    for host, args in argv.items():
        c.procs[host] = _popen(lab, host, args, logs[host])
    return c


@pytest.fixture(scope="module")
def clusters(
    lab: NetLab, pd_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, MultiHost]]:
    """Each setup: router, prefill and decode on three hosts, TCP transport.

    The decode worker's KV receiver listens on `--kv-host`, which is also the
    address it reports to the router and the router hands to prefill.
    """
    started: dict[str, MultiHost] = {}
    try:
        for setup in SETUPS:
            tmp = tmp_path_factory.mktemp(f"multihost-{setup.name}")
            started[setup.name] = _start(lab, setup, pd_checkpoint, tmp)
        for c in started.values():
            c.url = _wait_for_router(c)
        yield started
    finally:
        for c in started.values():
            c.close_clients()
        stop_all([p for c in started.values() for p in c.procs.values()])


def _texts(c: MultiHost) -> list[str]:
    client = c.client()
    return [_complete(client, c.model, p) for p in PROMPTS]


def _wait_idle(c: MultiHost, deadline_s: float = 60) -> list[dict[str, object]]:
    """Until both pools hold no request pages and nothing is pending (I7); returns the pools."""
    end = time.monotonic() + deadline_s
    pools: list[dict[str, object]] = []
    while time.monotonic() < end:
        pools = list(c.info()["pools"])  # type: ignore[call-overload]
        decode = [p for p in pools if p["role"] == "decode"]
        if decode and all(p["pages_used"] == 0 and p["pages_pending"] == 0 for p in decode):
            return pools
        time.sleep(0.2)
    raise AssertionError(f"decode pages still held after {deadline_s} s: {pools}")


def test_three_hosts_equal_single_process(
    clusters: dict[str, MultiHost], pd_checkpoint: Path
) -> None:
    cluster = clusters["llama"]
    rx0, _ = cluster.lab.eth0_bytes("decode")
    got = cluster.on_client(_texts, cluster)
    rx1, _ = cluster.lab.eth0_bytes("decode")
    info = cluster.info()
    assert info["disaggregated"] is True and info["transport"] == "tcp"
    assert sorted(p["role"] for p in info["pools"]) == ["decode", "prefill"]  # type: ignore[union-attr]
    # The KV really crossed the link: decode's only interface received at least
    # the longest prompt's pages (every byte of it came from the prefill host).
    geometry = ModelConfig.from_file(pd_checkpoint / "config.json").kv_geometry(page_size=16)
    longest = max(len(Tokenizer.from_dir(pd_checkpoint).encode(p)) for p in PROMPTS)
    assert rx1 - rx0 >= longest * geometry.bytes_per_token, (rx0, rx1)
    _wait_idle(cluster)
    assert got == _single_process_texts(pd_checkpoint), cluster.diagnostics()


def test_tenants_get_their_own_echo_across_hosts(
    clusters: dict[str, MultiHost], pd_checkpoint: Path
) -> None:
    """12 concurrent streams from 4 tenants on the mirror model: each echoes exactly its own prompt."""
    cluster = clusters["mirror"]
    tokenizer = Tokenizer.from_dir(pd_checkpoint)
    tenants = ("a", "b", "c", "d")
    clients = {t: cluster.client(t) for t in tenants}

    def run(i: int) -> tuple[str, str]:
        tenant = tenants[i % 4]
        prompt = f"tenant {tenant} request {i:02d} secret-{i * 7919:05d} "
        stream = clients[tenant].completions.create(
            model=cluster.model,
            prompt=prompt,
            max_tokens=len(tokenizer.encode(prompt)),
            temperature=0,
            stream=True,
        )
        return prompt, "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    results = cluster.map_on_client(run, 12)
    assert [text for _, text in results] == [prompt for prompt, _ in results]
    _wait_idle(cluster)
    metrics = cluster.on_client(_metrics, cluster)
    assert re.search(r"^kvfence_isolation_violations(_total)? 0(\.0)?$", metrics, re.M), metrics
    assert re.search(r"^kvfence_transfer_failures(_total)? 0(\.0)?$", metrics, re.M), metrics


def _metrics(c: MultiHost) -> str:
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.get(c.url + "/metrics", headers={"Authorization": f"Bearer {c.key('operator')}"})
    assert r.status_code == 200, r.text
    return r.text


def test_unreachable_kv_address_fails_the_request(clusters: dict[str, MultiHost]) -> None:
    """Decode reports a KV address on its own loopback: prefill cannot reach it from its
    host, so the request ends with an error (never a hang or a 200) and decode's
    reservation is released; the same request succeeds where decode listens on its link."""
    bad, good = clusters["loopback-kv"], clusters["mirror"]

    def attempt(c: MultiHost) -> str:
        try:
            r = c.client().completions.create(
                model=c.model, prompt="cross the link", max_tokens=4, temperature=0
            )
            return f"ok:{r.choices[0].text}"
        except openai.APIStatusError as e:
            return f"error:{e.status_code}:{e.message}"

    outcome = bad.on_client(attempt, bad)
    assert outcome.startswith("error:502") and "transfer" in outcome, outcome
    assert good.on_client(attempt, good).startswith("ok:cross")
    _wait_idle(bad)
    metrics = bad.on_client(_metrics, bad)
    assert re.search(r"^kvfence_transfer_failures(_total)? [1-9]", metrics, re.M), metrics


def test_lab_is_torn_down_even_when_the_body_fails() -> None:
    prefix = ""
    try:
        with netlab(("one", "two")) as small:
            prefix = small.prefix
            assert len(namespaces_named(prefix)) == 3  # lan + two hosts
            raise RuntimeError("body failed")
    except NamespacesRefused as e:
        pytest.skip(f"network namespaces are not available here: {e}")
    except RuntimeError as e:
        assert str(e) == "body failed"
    assert prefix and namespaces_named(prefix) == []
