"""Fixtures for the audit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from audit_replay import ReplayServer, serve


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
