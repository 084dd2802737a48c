"""Private network namespaces joined by one bridge: a small "LAN" of hosts for multi-host tests.

Layout (every name starts with `kvf-<random>-`): a `lan` namespace holds the
bridge `br0`; each host namespace has a single `eth0` (one end of a veth pair
whose other end is a port of `br0`) with an address in a private /24, and `lo`.
Nothing is created in the root namespace, so no packet can reach the host's
real interfaces: the hosts' only route is their /24 on `eth0`.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000


class NamespacesRefused(RuntimeError):
    """The kernel or our privileges do not allow creating network namespaces here."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")


def _enter(ns: str) -> None:
    """Move the calling thread (only it) into namespace `ns`; its new sockets live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class NetLab:
    prefix: str  # kvf-<random>
    subnet: str  # "10.X.Y": host i has 10.X.Y.(i+1)
    hosts: tuple[str, ...]

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def ip(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts.index(host) + 1}"

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """Run argv on `host` (`ip netns exec` execs it: the Popen pid is the program's)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def eth0_bytes(self, host: str) -> tuple[int, int]:
        """(rx, tx) byte counters of the host's only link."""
        r = subprocess.run(
            ["ip", "-j", "-s", "-n", self.ns(host), "link", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        stats = json.loads(r.stdout)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def threads_on(self, host: str, n: int) -> ThreadPoolExecutor:
        """A thread pool whose threads live in `host`'s namespace (a client on that host)."""
        return ThreadPoolExecutor(n, initializer=_enter, initargs=(self.ns(host),))


@contextmanager
def netlab(hosts: Sequence[str]) -> Iterator[NetLab]:
    """Create the namespaces; always delete every one created (that also removes the links).

    Raises `NamespacesRefused` (before anything exists) when `ip netns add` is not allowed.
    """
    if shutil.which("ip") is None:
        raise NamespacesRefused("the `ip` command (iproute2) is not installed")
    prefix = f"kvf-{secrets.token_hex(3)}"
    subnet = f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(250) + 1}"
    probe = subprocess.run(
        ["ip", "netns", "add", f"{prefix}-lan"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        raise NamespacesRefused(f"`ip netns add` refused: {probe.stderr.strip()}")
    made = [f"{prefix}-lan"]
    try:
        _ip("-n", made[0], "link", "set", "lo", "up")
        for host in hosts:
            _ip("netns", "add", f"{prefix}-{host}")
            made.append(f"{prefix}-{host}")
            _ip("-n", f"{prefix}-{host}", "link", "set", "lo", "up")
        _wire(prefix, subnet, hosts)
        yield NetLab(prefix, subnet, tuple(hosts))
    finally:
        failures = []
        for ns in reversed(made):
            r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if r.returncode != 0:
                failures.append(f"{ns}: {r.stderr.strip()}")
        if failures:
            raise RuntimeError(f"could not delete namespaces: {failures}")


def _wire(prefix: str, subnet: str, hosts: Sequence[str]) -> None:
    lan = f"{prefix}-lan"
    _ip("-n", lan, "link", "add", "br0", "type", "bridge")
    _ip("-n", lan, "link", "set", "br0", "up")
    for i, host in enumerate(hosts):
        ns, port = f"{prefix}-{host}", f"v-{host}"[:15]
        _ip("-n", lan, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", lan, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")


def namespaces_named(prefix: str) -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(prefix)]


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"<{path}: {e}>"


def popen_on(lab: NetLab, host: str, argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """Start argv on `host`, stdout and stderr to `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(lab.exec_argv(host, argv), stdout=out, stderr=subprocess.STDOUT)


def stop_all(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 10) -> None:
    """SIGTERM all, then SIGKILL what is left after `grace_s` (a worker that closed its
    sockets can still spend many seconds in interpreter finalization on a loaded machine)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
