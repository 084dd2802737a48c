"""Addresses on one host leave no window in which another process can take them.

The hub's roles bind Unix sockets in the supervisor's private directory; a port number that
a program must be told is drawn below the kernel's ephemeral range; the embedded audit's
servers bind port 0 and say where they listen.
"""

from __future__ import annotations

import socket
import stat
import time
from pathlib import Path

import pytest
import zmq

from kvfence.audit.embedded import started_all, wait_ready
from kvfence.engine.messages import Abort
from kvfence.hub.launch import IPC_PATH_MAX, Loopback
from kvfence.serve.channel import Inbox, Outbox
from kvfence.serve.supervisor import EPHEMERAL_DEFAULT, ephemeral_range, free_port


def test_loopback_inboxes_are_unix_sockets_in_the_given_directory(tmp_path: Path) -> None:
    addrs = Loopback.pick(2, 3, tmp_path)
    every = [addrs.router, *addrs.prefill, *addrs.decode]
    assert len(set(every)) == 6 and len(addrs.prefill) == 2 and len(addrs.decode) == 3
    for addr in every:
        assert addr.startswith("ipc://")
        assert Path(addr.removeprefix("ipc://")).parent == tmp_path


def test_a_loopback_inbox_carries_messages(tmp_path: Path) -> None:
    """One role's inbox at a picked address gets what another role sends it, through a
    socket file in the directory."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    addrs = Loopback.pick(1, 1, tmp_path)
    inbox = Inbox(ctx, addrs.prefill[0], [Abort])
    out = Outbox(ctx, addrs.prefill[0])
    try:
        out.send(Abort(room="r-1", reason="test"))
        got: list[object] = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = list(inbox.poll(100))
        assert got == [Abort(room="r-1", reason="test")]
        assert stat.S_ISSOCK(Path(addrs.prefill[0].removeprefix("ipc://")).stat().st_mode)
    finally:
        out.close()
        inbox.close()
        ctx.term()


def test_a_socket_path_too_long_for_unix_sockets_is_refused_naming_tmpdir(
    tmp_path: Path,
) -> None:
    deep = tmp_path / ("d" * (IPC_PATH_MAX - len(str(tmp_path))))
    with pytest.raises(ValueError, match="TMPDIR") as e:
        Loopback.pick(1, 1, deep)
    assert str(IPC_PATH_MAX) in str(e.value)


def test_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(f) == (40000, 50000)
    f.write_text("garbage\n")
    assert ephemeral_range(f) == EPHEMERAL_DEFAULT
    assert ephemeral_range(tmp_path / "absent") == EPHEMERAL_DEFAULT


def test_free_port_lies_below_the_ephemeral_range_and_is_bindable() -> None:
    lo, _ = ephemeral_range()
    if lo < 20000 + 4096:
        pytest.skip(f"this kernel's ephemeral range starts at {lo}: no room below it")
    ports = {free_port() for _ in range(20)}
    assert all(p < lo for p in ports)
    assert len(ports) > 1  # drawn at random, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_an_embedded_server_that_exits_is_reported_at_once_with_its_log(tmp_path: Path) -> None:
    """`wait_ready` names a server that died before it said where it listens, with the end
    of its log, instead of polling a port nobody will answer on until its deadline."""
    start = time.monotonic()
    with (
        started_all((("broken", ("--kv-pages", "nonsense")),), tmp_path) as starting,
        pytest.raises(RuntimeError, match="embedded server broken: the process exited with") as e,
    ):
        wait_ready(starting[0])
    assert "--kv-pages" in str(e.value)
    assert time.monotonic() - start < 60
