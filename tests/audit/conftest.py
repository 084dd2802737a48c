"""Fixtures for the audit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from audit_replay import ReplayServer, serve
from audit_servers import INCIDENT_FAULTS, LARGE, SMALL_PREFILL, Server, start, stop, wait_ready


@pytest.fixture
def replay() -> Iterator[ReplayServer]:
    state = ReplayServer()
    httpd, t = serve(state)
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join()


@pytest.fixture(scope="session")
def kvfence_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """Three real `kvfence serve` processes (mirror model, lab scale), started in parallel:
    hardened; the undersized-pool fault alone; the whole incident combination."""
    tmp = tmp_path_factory.mktemp("audit-servers")
    servers = {
        "hardened": start(tmp, "hardened", pages=LARGE),
        "undersized": start(tmp, "undersized", pages=SMALL_PREFILL, faults=("undersized-pool",)),
        "incident": start(tmp, "incident", pages=SMALL_PREFILL, faults=INCIDENT_FAULTS),
    }
    try:
        for s in servers.values():
            wait_ready(s)
        yield servers
    finally:
        for s in servers.values():
            stop(s)
