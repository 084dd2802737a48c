from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from metrics_helpers import Stepped, stepped_server

from kvfence.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("metrics-ckpt") / "tiny", seed=0)


@pytest.fixture
def stepped(checkpoint: Path) -> Iterator[Stepped]:
    """A real server whose engine thread is not started: the test steps it (`pump`)."""
    with stepped_server(checkpoint) as s:
        yield s
